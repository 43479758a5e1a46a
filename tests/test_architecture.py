"""scripts/architecture.py: the project's modules import each other without a loop, and the
render path the picture draws names modules that exist."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_import_loop_and_the_render_path_exists():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "architecture.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "no import loop" in done.stdout


def test_a_loop_is_found(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import architecture
    finally:
        sys.path.pop(0)
    assert architecture.find_loop({"a/x": {"a/y"}, "a/y": {"a/z"}, "a/z": {"a/x"}}) == ["a/x", "a/y", "a/z", "a/x"]
    assert architecture.find_loop({"a/x": {"a/y"}, "a/y": set()}) == []
