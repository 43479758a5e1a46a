"""The table of every stable-policy setting tried when the stable policy was chosen (docs/results.md): CR-Full's recall
and its cost with its own prefix cache (ratio to `full`) per budget, from the replays kept in
docs/results/settings_tried/ (`contextrender replay ... --selector contextrender --json --set k=v`
on the first 12 mini-SWE traces and the first 60 tau-bench traces; each file lists its settings).

The runs were made while the policy was being built, so a row's label also names what the code did
then (no partial re-renders, an early re-render rule since removed, a fixed headroom before it was
scaled); a file's `settings` are the settings it passed.

    .venv/bin/python scripts/settings_tried.py
"""

from __future__ import annotations

import json
from pathlib import Path

RUNS = Path(__file__).resolve().parent.parent / "docs" / "results" / "settings_tried"
TRIED = [
    ("per-call, prose_share 1.0 (the paper's renderer; before the policy)", "base"),
    ("stable, headroom 0 (fixed share of B), no partial re-renders, prose_share 1.0", "s_h0"),
    ("stable, headroom 0.05", "s_h05"),
    ("stable, headroom 0.1", "s_h10"),
    ("stable, headroom 0.2", "s_h20"),
    ("stable, headroom 0.3", "s_h30"),
    ("stable, headroom 0.2 + early re-render when the fresh selection gains >= 0.5 usefulness", "s_h20_g05"),
    ("stable, headroom 0.1, prose_share 0.25", "s_h10_p25"),
    ("stable, headroom 0.1, prose_share 0.4", "s_h10_p40"),
    ("stable, headroom 0.2, prose_share 0.25", "s_h20_p25"),
    ("stable, headroom 0.2, prose_share 0.15", "s_h20_p15"),
    ("... + cost-aware partial re-renders, cache_value 1", "s_h20_p15_cv1"),
    ("... + cost-aware partial re-renders, cache_value 3", "s_h20_p15_cv3"),
    ("headroom 0.2, prose_share 0.15, cache_value 6", "t_h0.2_cv6"),
    ("headroom 0.3, prose_share 0.15, cache_value 3", "t_h0.3_cv3"),
    ("headroom 0.3, prose_share 0.15, cache_value 6", "t_h0.3_cv6"),
    ("headroom 0.4, prose_share 0.15, cache_value 3", "t_h0.4_cv3"),
    ("headroom 0.4 scaled by B / full history, prose_share 0.15, cache_value 3", "a_h0.4"),
    ("headroom 0.5 scaled, prose_share 0.15, cache_value 3", "a_h0.5"),
    ("headroom 0.6 scaled, prose_share 0.15, cache_value 3", "a_h0.6"),
    ("headroom 0.5 scaled, prose_share 0.15, cache_value 3, stickiness 0.2", "a_h0.5_s02"),
    ("**headroom 0.5 scaled, prose_share 0.15, cache_value 3, condense (the defaults)**", "d_cond"),
]
BUDGETS = {"swe": (3000, 6000, 12000, 24000), "tau": (1000, 2000, 3000)}


def cell(name: str, traces: str, budget: int) -> str:
    path = RUNS / f"{name}_{traces}.json"
    if not path.exists():
        return "-"  # that setting was not run on this trace set
    for row in json.loads(path.read_text())["rows"]:
        if row["selector"] == "contextrender" and row["budget"] == budget:
            return f"{row['recall']:.1f} / {row['ratio_cached']:.2f}"
    return "-"


def main() -> None:
    print("| setting | mini-SWE 3K | 6K | 12K | 24K | tau 1K | 2K | 3K |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, name in TRIED:
        cells = [cell(name, traces, b) for traces in ("swe", "tau") for b in BUDGETS[traces]]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
