"""benchmarks/engine_bench.py's summary of alternated ingestion rows: medians and paired ratios."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import engine_bench  # noqa: E402


def test_an_ingestion_line_gives_its_row_and_its_cpu_rate() -> None:
    line = ("ingest, 2,000 results (1.6 MB of result text), 10 round(s) per call: 0.57 MB/s "
            "(0.58 MB/s of CPU time)  (fresh process)")
    found = engine_bench.CPU_RATE.match(line)
    assert found is not None
    assert found["row"] == "ingest, 2,000 results (1.6 MB of result text), 10 round(s) per call"
    assert float(found["cpu"]) == 0.58
    assert engine_bench.CPU_RATE.match("  append: 3.1 ms") is None


def test_paired_ratios_are_the_median_of_each_rounds_own() -> None:
    # The medians (1.2 and 1.0) give x1.20; the rounds' own ratios (1.11, 0.6, 3.0) give x1.11.
    pairs = [(1.0, 0.9), (1.2, 2.0), (3.0, 1.0)]
    (head, row) = engine_bench.paired_lines({"one call": pairs}, "/work/other")
    assert head == "medians over the rounds, MB/s of CPU time, this checkout against /work/other:"
    assert row == "  one call: 1.20 against 1.00, x1.20, paired x1.11, faster in 2 of 3"
