"""A venv for the Hermes integration's tests: hermes-agent 0.19.0 pins PyJWT 2.13.0, which the
server stack (jac-scale 0.2.31: pyjwt < 2.11) refuses, so Hermes cannot share the project's .venv.
The engine in-process needs only its runtime (jaclang, byllm, litellm, tiktoken, numpy, wordllama),
which installs beside Hermes; the project goes in without its dependencies (and without its jac
server plugin, which imports jac-scale: JAC_DISABLED_PLUGINS)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The same pins as pyproject.toml's [hermes] extra.
HERMES_STACK = ["hermes-agent==0.19.0", "jaclang==0.16.7", "byllm==0.6.19", "litellm==1.82.6", "tiktoken==0.14.0",
                "numpy==2.5.5", "wordllama==0.4.0.post1", "httpx==0.28.1", "llvmlite==0.47.0"]
ENV = {"JAC_DISABLED_PLUGINS": "contextrender:server", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def hermes_python() -> Path:
    """The venv's python (made once under .venv-hermes, or $CONTEXTRENDER_HERMES_VENV)."""
    venv = Path(os.environ.get("CONTEXTRENDER_HERMES_VENV") or ROOT / ".venv-hermes")
    python = venv / "bin" / "python"
    stamp = venv / f".installed-{hashlib.sha1(' '.join(HERMES_STACK).encode()).hexdigest()[:12]}"
    if not stamp.exists():
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run(pip + HERMES_STACK, check=True, timeout=1800)
        subprocess.run(pip + ["--no-deps", "-e", str(ROOT)], check=True, timeout=600)
        stamp.touch()
    return python
