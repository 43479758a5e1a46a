"""How a process that is not `jac start` loads the Jac modules: where they are (`JAC_ROOT`) and
jaclang imported without the server's plugins (`import_jaclang`).

Which of jaclang's plugins a process loads. jaclang imports every plugin of the `jac` entry-point
group when it is itself imported; jac-scale's (the server: FastAPI, SQLAlchemy, its auth and
storage layers) took 5-18 s of every start on these cores, in processes that never serve (the
in-process engine, the proxy, a replay, the client). A process that imports this package before
jaclang is not `jac start` (which imports jaclang first), so jaclang is imported here with
jac-scale's plugins disabled, added to whatever the user
disabled (JAC_DISABLED_PLUGINS, or the nearest jac.toml's [plugins].disabled, which the variable
would otherwise replace). byLLM's plugin stays: the summariser's `by llm` calls need it.

CONTEXTRENDER_JAC_PLUGINS=all keeps every plugin (a process that imports ContextRender and then
serves with jac-scale in-process). The environment is restored after the import, so the processes
this one starts (`jac start`, `contextrender serve`) load their plugins as usual.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

__all__ = ["JAC_ROOT", "NOT_SERVING", "compile_notice", "import_jaclang", "jac_modules", "user_disabled"]

# The Jac modules (contextrender.jac, graph/, engine/, walkers/): in an installed wheel under jac/ in
# this package (setup.py), in a checkout (or an editable install) at the top of the checkout.
_INSTALLED = Path(__file__).resolve().parent / "jac"
JAC_ROOT = _INSTALLED if (_INSTALLED / "contextrender.jac").is_file() else Path(__file__).resolve().parent.parent

# What a process that does not serve leaves out (jaclang's "package:plugin" / "package:*" names).
NOT_SERVING = ("jac-scale:*",)


def user_disabled(cwd: Path | None = None) -> list[str]:
    """The plugins the user disabled, read as jaclang reads them: JAC_DISABLED_PLUGINS when set,
    else the nearest jac.toml (from `cwd` up) and its [plugins].disabled."""
    listed = os.environ.get("JAC_DISABLED_PLUGINS", "").strip()
    if listed:
        return [name.strip() for name in listed.split(",") if name.strip()]
    folder = (cwd or Path.cwd()).resolve()
    for candidate in (folder, *folder.parents):
        toml = candidate / "jac.toml"
        if toml.is_file():
            try:
                disabled = tomllib.loads(toml.read_text(encoding="utf-8")).get("plugins", {}).get("disabled", [])
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
                return []  # jaclang warns about a malformed jac.toml itself, and disables nothing
            return [str(name) for name in disabled] if isinstance(disabled, list) else []
    return []


def import_jaclang() -> None:
    """Put the Jac modules on the path and import jaclang (its .jac import hook) without the
    server's plugins, unless it is loaded; then jaclang's serializer (below)."""
    if str(JAC_ROOT) not in sys.path:
        sys.path.insert(0, str(JAC_ROOT))
    # litellm (imported by byLLM) otherwise tries to download its price list at import; there is no
    # network on many agent hosts, and its bundled copy is what we want.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    _import()
    # Stored nodes are rebuilt only from classes jaclang's serializer registered, and it registers a
    # class when the class is made, if the serializer is loaded by then. jac-scale's plugin loads it
    # first; without jac-scale (the engine beside Hermes) every stored session was unreadable.
    from jaclang.runtimelib import serializer  # noqa: F401
    # jaclang's runtime calls bound without `inspect` at every call (about 16 % of a long ingestion).
    from contextrender import dispatch

    dispatch.install()


def _import() -> None:
    if "jaclang" in sys.modules or os.environ.get("CONTEXTRENDER_JAC_PLUGINS", "").strip().lower() == "all":
        import jaclang  # noqa: F401
        return
    disabled = user_disabled()
    saved = os.environ.get("JAC_DISABLED_PLUGINS")
    os.environ["JAC_DISABLED_PLUGINS"] = ",".join(dict.fromkeys([*disabled, *NOT_SERVING]))
    try:
        import jaclang  # noqa: F401
    finally:
        if saved is None:
            del os.environ["JAC_DISABLED_PLUGINS"]
        else:
            os.environ["JAC_DISABLED_PLUGINS"] = saved


# Seconds a first compile runs before it says so, then between its progress lines.
NOTICE_AFTER = 3.0
NOTICE_EVERY = 10.0


def jac_modules() -> list[Path]:
    """The Jac modules of graph/, engine/ and walkers/ (not their impl files): what a first use
    in a checkout compiles."""
    return sorted(p for d in ("graph", "engine", "walkers") for p in (JAC_ROOT / d).rglob("*.jac")
                  if p.is_file() and ".jac" not in p.relative_to(JAC_ROOT).parts[:-1] and ".impl." not in p.name)


def _uncompiled() -> list[Path]:
    """The modules jaclang has no module cache file for where this process would look (empty
    for a wheel install: it loads the precompiled bundle)."""
    if JAC_ROOT == _INSTALLED:
        return []
    from jaclang.jac0core.jir import get_module_cache_path

    return [m for m in jac_modules() if not get_module_cache_path(str(m)).exists()]


@contextlib.contextmanager
def compile_notice(stream: object = None) -> Iterator[None]:
    """Around an import of the Jac modules: when some are not compiled yet (the first use in a
    checkout) and the import takes more than NOTICE_AFTER seconds, say on stderr that they
    compile once and show progress (modules compiled, seconds) until the import is done."""
    if getattr(_notice, "active", False):  # an import inside one already watched
        yield
        return
    try:
        pending = _uncompiled()
    except Exception:  # noqa: BLE001 - jaclang's cache layout changed: no notice, nothing else
        pending = []
    if not pending:
        yield
        return
    out = stream or sys.stderr
    done = threading.Event()
    started = time.monotonic()
    said: list[bool] = []

    def watch() -> None:
        from jaclang.jac0core.jir import get_module_cache_path

        wait = NOTICE_AFTER
        while not done.wait(wait):
            left = sum(1 for m in pending if not get_module_cache_path(str(m)).exists())
            if not said:
                print(f"contextrender: compiling the Jac modules of this checkout, once ({len(pending)} modules; "
                      "a minute or more; later starts load them from jaclang's cache)", file=out, flush=True)
                said.append(True)
            print(f"contextrender: compiled {len(pending) - left} of {len(pending)} modules, "
                  f"{time.monotonic() - started:.0f} s", file=out, flush=True)
            wait = NOTICE_EVERY

    watcher = threading.Thread(target=watch, name="contextrender-compile-notice", daemon=True)
    _notice.active = True
    watcher.start()
    try:
        yield
    finally:
        _notice.active = False
        done.set()
        watcher.join()
        if said:
            from jaclang.jac0core.jir import get_module_cache_path

            compiled = sum(1 for m in pending if get_module_cache_path(str(m)).exists())
            print(f"contextrender: compiled {compiled} of {len(pending)} modules in {time.monotonic() - started:.0f} s "
                  "(the rest load when used); done", file=out, flush=True)


_notice = threading.local()
