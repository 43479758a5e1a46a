"""Builds the wheel with the Jac engine inside it (the metadata is in pyproject.toml).

The Jac modules (contextrender.jac, jac.toml, graph/, engine/, walkers/) live at the top of the
checkout, where `jac start contextrender.jac` serves them. A wheel carries them as package data
under `contextrender/jac/` (pyproject.toml maps graph/, engine/ and walkers/ there; this
file copies the entry module and jac.toml beside them), and, compiled by jaclang's own bundler
(`jaclang/utils/precompile_bytecode.jac`), as `contextrender/_precompiled/cpython-3XX/`:
jaclang loads a module from that bundle when the module's source, its impl files and the jaclang
and Python versions match the key the bundle was stamped with, so an installed engine does not
compile on its first start. Each bundle file also carries its module's access table (jaclang's
interop section, copied from the bundler's compile: `_add_access_tables`), which `contextrender
serve` reads instead of compiling the modules again (adapters/server/access_table.py). An editable
install uses the checkout itself and gets neither.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PACKAGE = "contextrender"
ENTRY_FILES = ("contextrender.jac", "jac.toml")


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
            # Every module compiled, so that each writes its module cache file (with the interop
            # section `_add_access_tables` copies): a bundle an earlier build left in this build
            # folder would be loaded instead (its key matches), and nothing written. Removed here
            # rather than compiling with JAC_REBUILD=1, which ignores every cache, jaclang's own
            # precompiled modules included: the build took 284 s wall (180 s CPU) with it, 32 s without.
            shutil.rmtree(package / "_precompiled", ignore_errors=True)
            env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True")
            env.pop("JAC_REBUILD", None)
            # The bundler's lines as they come (one per module; shown by `pip wheel -v` and
            # `python -m build`, which do not hide a build's output), with the seconds so far.
            print("setup.py: precompiling the Jac modules (half a minute; more on loaded cores)", file=sys.stderr, flush=True)
            started = time.monotonic()
            lines: list[str] = []
            with subprocess.Popen([sys.executable, "-m", "jaclang", "run", str(script), str(source)], cwd=scratch, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as bundler:
                for line in bundler.stdout:
                    lines.append(line)
                    if line.strip():
                        print(f"setup.py: [{time.monotonic() - started:4.0f} s] {line.rstrip()}", file=sys.stderr, flush=True)
            output = "".join(lines)
        compiled = list((package / "_precompiled").rglob("*.jir"))
        if bundler.returncode != 0 or "0 failed" not in output or not compiled:
            raise RuntimeError(f"precompiling the Jac modules failed:\n{output[-4000:]}")
        tables = _add_access_tables(package, compiled)
        # Compiling leaves jaclang's per-folder module cache (.jac/cache) beside the sources: it is
        # keyed by this build's paths and does not belong in the wheel.
        for cache in [p for p in package.rglob(".jac") if p.is_dir()]:
            shutil.rmtree(cache)
        self.announce(f"precompiled {len(compiled)} Jac modules, {tables} with their access table", level=2)


def _add_access_tables(package: Path, compiled: list[Path]) -> int:
    """Copy each module's interop section (its walkers' and functions' access levels, which
    `jac start` serves by) from the module cache the bundler's compile wrote into the module's
    bundle file, matched by module key; returns how many bundle files got one.

    jaclang's bundle files hold only the bytecode and the key, and a wheel install loads from them,
    so its module cache has no table and `contextrender serve` would compile every module again
    to read the access levels; adapters/server/access_table.py reads them from the bundle file instead.
    jaclang reads only the bundle's bytecode section, so the extra section changes nothing else.
    """
    from jaclang.jac0core.jir import HEADER_SIZE, SEC_INTEROP, SECTIONS_MAGIC, read_modkey, read_sections, write_sections

    def sections(data: bytes) -> tuple[int, dict[int, bytes]]:
        start = data.find(SECTIONS_MAGIC, HEADER_SIZE)
        return (start, read_sections(data, start + len(SECTIONS_MAGIC)) if start >= 0 else {})

    tables: dict[str, bytes] = {}
    for cache in package.rglob(".jac/cache/*.jir"):
        data = cache.read_bytes()
        (_, found) = sections(data)
        key = read_modkey(data)
        if key and SEC_INTEROP in found:
            tables[key] = found[SEC_INTEROP]
    added = 0
    for path in compiled:
        data = path.read_bytes()
        (start, found) = sections(data)
        table = tables.get(read_modkey(data) or "")
        if start < 0 or table is None:
            continue
        found[SEC_INTEROP] = table
        path.write_bytes(data[:start] + write_sections(found))
        added += 1
    return added


# The wheel holds bytecode for this Python only (the precompiled bundle): tagged cp3XX, not py3.
PYTHON_TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"
setup(cmdclass={"build_py": BuildWithJac},
      options={} if os.environ.get("CONTEXTRENDER_NO_PRECOMPILE") else {"bdist_wheel": {"python_tag": PYTHON_TAG}})
