"""A venv for the Hermes integration's tests, made as a user installs it: the project with its
`[hermes]` extra (`pip install -e ".[hermes]"`, on the tested versions of constraints.txt). It is
not the project's .venv: hermes-agent 0.19.0 pins PyJWT 2.13.0, which the server's extra
(jac-scale 0.2.31: pyjwt < 2.11, in [test]) refuses; the core installs beside Hermes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTRA = "hermes"


def requirements_key() -> str:
    """What the venv's contents depend on: the core's dependencies, the extra, the constraints (not
    the rest of pyproject.toml, so an edit of, say, the entry points does not rebuild the venv)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    parts = [*project["dependencies"], *project["optional-dependencies"][EXTRA], (ROOT / "constraints.txt").read_text()]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]


def hermes_python() -> Path:
    """The venv's python (made once under .venv-hermes, or $CONTEXTRENDER_HERMES_VENV)."""
    venv = Path(os.environ.get("CONTEXTRENDER_HERMES_VENV") or ROOT / ".venv-hermes")
    python = venv / "bin" / "python"
    stamp = venv / f".installed-{requirements_key()}"
    if not stamp.exists():
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-e", f"{ROOT}[{EXTRA}]",
                        "-c", str(ROOT / "constraints.txt")], check=True, timeout=1800)
        stamp.touch()
    return python
