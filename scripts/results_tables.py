"""The tables of docs/results.md (recall, both cost ratios, cache hits, re-renders) from a sweep's raw
files, one column per trace set and budget:

    .venv/bin/python scripts/results_tables.py docs/results/raw
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from contextrender_eval.evaluate import Prices
from contextrender_eval.sweep_report import STYLE, dataset_rows

SETS = [
    ("tau_bench", "tau", (1000, 2000, 3000)),
    ("swe_agent_demos", "SWE demos", (3000, 6000, 12000, 24000)),
    ("mini_swe_agent_deepseek", "mini-SWE", (3000, 6000, 12000, 24000)),
]


def missing(value: float | None) -> bool:
    return value is None or value != value  # None or NaN


def number(digits: int) -> Callable[[float | None], str]:
    return lambda value: "-" if missing(value) else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", type=Path, help="the sweep's raw/ folder")
    raw = parser.parse_args().raw
    rows: dict[tuple[str, str, int], dict] = {}
    for name, _, _ in SETS:
        for row in dataset_rows(json.loads((raw / f"{name}.json").read_text()), Prices()):
            rows[(name, row["selector"], row["budget"])] = row
    columns = [(name, budget) for (name, _, budgets) in SETS for budget in budgets]
    header = "| selector | " + " | ".join(f"{label} {b // 1000}K" for (_, label, budgets) in SETS for b in budgets) + " |"
    rule = "|---|" + "---:|" * len(columns)

    def table(title: str, cell: Callable[[dict], str], totals: tuple = ()) -> None:
        print(f"\n{title}\n\n{header}\n{rule}")
        for selector in STYLE:
            cells = [cell(rows[(n, selector, b)]) if (n, selector, b) in rows else "-" for (n, b) in columns]
            print(f"| {selector} | " + " | ".join(cells) + " |")
        for label, total in totals:
            print(f"| {label} | " + " | ".join(total(rows[(n, 'full', b)]) for (n, b) in columns) + " |")

    two, one = number(2), number(1)
    table("Recall (%)", lambda r: one(r["recall"]), (
        ("events", lambda r: str(r["events"])), ("managed renders %", lambda r: f"{100 * r['managed_share']:.0f}")))
    table("Cost / full, equation 3 (rho = full's cache rate)", lambda r: two(r.get("ratio_eq3")))
    table("Cost / full, each method's own prefix cache", lambda r: two(r.get("ratio_cached")))
    table("Cache hits (% of input tokens, own cache)",
          lambda r: "-" if missing(r.get("own_cache_rate")) else f"{100 * r['own_cache_rate']:.0f}")
    table("Re-renders (% of managed renders)", lambda r: f"{100 * r['rerender_share']:.0f}")


if __name__ == "__main__":
    main()
