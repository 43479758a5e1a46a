"""benchmarks/miss_classes.py: the classes of the replay's missed events, and what a run leaves behind."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script():
    spec = importlib.util.spec_from_file_location("miss_classes", ROOT / "benchmarks" / "miss_classes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_miss_classes_removes_the_store_of_each_trace(tmp_path, monkeypatch, capsys):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    script = load_script()
    script.main([str(ROOT / "tests" / "fixtures" / "traces" / "tau_bench.jsonl"), "--budget", "1000", "--limit", "2", "--json"])
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert counts["events"] > 0 and counts["in_view"] <= counts["events"]
    # One store per trace, each removed once its trace is replayed (a run left them all before).
    assert list(scratch.iterdir()) == []
