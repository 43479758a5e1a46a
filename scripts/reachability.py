"""The table of every fold-index variant tried when the fold index was chosen (docs/restores.md): per trace set and
budget, the recall in view, in view or one restore away, and the cost with the prefix cache
(ratio to `full`), plain and with the oracle's restores, from the replays kept in
docs/results/reachability/ (`contextrender replay ... --selector contextrender --json [--oracle-restore]
--set k=v` on the first 12 mini-SWE traces at B = 6,000 and the first 60 tau-bench traces at
B = 2,000; each file lists its settings).

    .venv/bin/python scripts/reachability.py
"""

from __future__ import annotations

import json
from pathlib import Path

RUNS = Path(__file__).resolve().parent.parent / "docs" / "results" / "reachability"
TRIED = [
    ("no index (`fold_index_share=0`: today's marker)", "off"),
    ("describe only, newest first, share 0.05, the selection's room", "idx5_desc"),
    ("every handle first, then describe; share 0.03, the selection's room", "idx3"),
    ("every handle first, then describe; share 0.05, the selection's room", "idx5"),
    ("... share 0.05, the prose share's room", "room_prose"),
    ("... share 0.05, the headroom's room (the first defaults)", "room_headroom"),
    ("handles only (`fold_index_digest=0`), share 0.05, the headroom's room", "hd0"),
    ("handles only, share 0.1, the headroom's room", "hd0s10"),
    # The index sent apart (fold_index_place apart), after the selected results of folded turns.
    ("apart: every handle, then describe; share 0.05, the headroom's room", "apart_small"),
    ("apart, small results not listed; describe, the headroom's room", "apart"),
    ("apart, small not listed; describe, the selection's room", "apart_res"),
    ("apart, small not listed; handles only, the headroom's room", "apart_hd0"),
    ("apart, small not listed; handles only, the selection's room", "apart_hd0_res"),
    ("apart, small not listed; handles only, the prose share's room by its size", "prose_hd0"),
    # Descriptions back on the defaults (`fold_index_digest` N), tried at the merge.
    ("... the defaults, described in 16 characters", "prose_d16"),
    ("... the defaults, described in 24 characters", "prose_d24"),
    ("... the defaults, described in 40 characters", "prose_d40"),
    ("apart, small not listed; described in 24 characters, the headroom's room", "apart_d24"),
    # The heading that names the restore by query (3 tokens more): today's code.
    ("**the same, its heading naming the query form (the defaults)**", "heading"),
]
SETS = (("swe", "mini-SWE B=6K"), ("tau", "tau B=2K"))


def row(path: Path) -> dict | None:
    if not path.exists():
        return None
    return next(r for r in json.loads(path.read_text())["rows"] if r["selector"] == "contextrender")


def cells(name: str, traces: str) -> list[str]:
    plain, oracle = row(RUNS / f"{name}_{traces}.json"), row(RUNS / f"{name}_{traces}_oracle.json")
    out = [f"{plain['recall']:.1f}", f"{plain['reachable']:.1f}", f"{plain['ratio_cached']:.3f}"] if plain else ["-"] * 3
    if oracle:
        out += [f"{oracle['recall_after_restores']:.1f}", f"{oracle['restores']}", f"{oracle['ratio_cached']:.3f}"]
    else:
        out += ["-"] * 3
    return out


def main() -> None:
    columns = ["in view %", "in view or 1 restore %", "cost cache/full", "oracle: after restores %", "restores", "cost cache/full"]
    print("| variant | set | " + " | ".join(columns) + " |")
    print("|---|---|" + "---:|" * len(columns))
    for label, name in TRIED:
        for traces, title in SETS:
            print(f"| {label} | {title} | " + " | ".join(cells(name, traces)) + " |")


if __name__ == "__main__":
    main()
