"""Builds the wheel with the Jac engine inside it (the metadata is in pyproject.toml).

The Jac modules (contextrender_server.jac, jac.toml, graph/, engine/, walkers/) live at the top of the
checkout, where `jac start contextrender_server.jac` serves them. A wheel carries them as package data
under `contextrender_adapters/jac/` (pyproject.toml maps graph/, engine/ and walkers/ there; this
file copies the entry module and jac.toml beside them), and, compiled by jaclang's own bundler
(`jaclang/utils/precompile_bytecode.jac`), as `contextrender_adapters/_precompiled/cpython-3XX/`:
jaclang loads a module from that bundle when the module's source, its impl files and the jaclang
and Python versions match the key the bundle was stamped with, so an installed engine does not
compile on its first start. An editable install uses the checkout itself and gets neither.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PACKAGE = "contextrender_adapters"
ENTRY_FILES = ("contextrender_server.jac", "jac.toml")


class BuildWithJac(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        package = Path(self.build_lib) / PACKAGE
        for name in ENTRY_FILES:
            shutil.copy2(ROOT / name, package / "jac" / name)
        if os.environ.get("CONTEXTRENDER_NO_PRECOMPILE"):
            return
        self._precompile(package)

    def _precompile(self, package: Path) -> None:
        try:
            import jaclang
        except ImportError:
            self.warn("jaclang is not installed where the wheel is built: the Jac modules are not precompiled")
            return
        script = Path(jaclang.__file__).resolve().parent / "utils" / "precompile_bytecode.jac"
        with tempfile.TemporaryDirectory() as scratch:
            # The bundler precompiles the first package folder it finds in the folder it is given;
            # give it one holding only this package, and run it where its own caches can go.
            source = Path(scratch) / "src"
            source.mkdir()
            (source / PACKAGE).symlink_to(package.resolve(), target_is_directory=True)
            env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", JAC_DISABLED_PLUGINS="contextrender:server")
            result = subprocess.run(
                [sys.executable, "-m", "jaclang", "run", str(script), str(source)],
                cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
        # Compiling leaves jaclang's per-folder module cache (.jac/cache) beside the sources: it is
        # keyed by this build's paths and does not belong in the wheel.
        for cache in [p for p in package.rglob(".jac") if p.is_dir()]:
            shutil.rmtree(cache)
        compiled = list((package / "_precompiled").rglob("*.jir"))
        if result.returncode != 0 or "0 failed" not in result.stdout or not compiled:
            raise RuntimeError(f"precompiling the Jac modules failed:\n{result.stdout[-4000:]}")
        self.announce(f"precompiled {len(compiled)} Jac modules", level=2)


setup(cmdclass={"build_py": BuildWithJac})
