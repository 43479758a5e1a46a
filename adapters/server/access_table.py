"""The walkers' access levels (public or login required) read from jaclang's compile cache, so
`jac start` does not compile the entry module and everything it imports from source again.

jaclang 0.16.7's `ModuleIntrospector` reads each endpoint's access level from the compiled
`interop_manifest` of the entry module and of the modules it imports. When the entry module came
from the compile cache (a warm start) it is not in the program's hub, so `_load_manifest` and
`_extract_access_levels` compile it from source, type inference included: about half of a warm
start. Each module's cache file (`.jir`) already carries that table (jaclang writes
`walker_access`, `func_access` and `endpoint_effects` into its interop section "so a warm-cache
load keeps the serve access table populated"); this reads it, for the entry module and every
module that defines something in the entry module's namespace (its `import from` providers). In a
wheel install the modules load from the wheel's precompiled bundle (`_precompiled/`), whose files
setup.py builds with the same section: it is read from there when the module cache has none.

Used only with the pinned jaclang and jac-scale, an entry module without client code, and cache
files that match their sources (jaclang's own key check); on anything else (a missing or stale
cache file, a module with no table, an unreadable section) the original methods run, compile
included. CONTEXTRENDER_ACCESS_FROM_CACHE=0 turns this off. docs/performance.md (Start) has the figures.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

logger = logging.getLogger("contextrender.server")

PINNED = {"jaclang": "0.16.7", "jac-scale": "0.2.31"}


def pinned() -> bool:
    try:
        return all(version(name) == want for (name, want) in PINNED.items())
    except PackageNotFoundError:
        return False


def _bundle_file(source: str) -> Path | None:
    """The file of the `_precompiled/` bundle (a wheel's, setup.py) that jaclang would load `source`
    from, found as jaclang finds it: the nearest folder above `source` holding `_precompiled/`."""
    source = os.path.normpath(os.path.abspath(source))
    folder = os.path.dirname(source)
    while True:
        bundle = os.path.join(folder, "_precompiled")
        if os.path.isdir(bundle):
            relative = os.path.splitext(source[len(folder) + 1:])[0] + ".jir"
            return Path(bundle, f"cpython-{sys.version_info.major}{sys.version_info.minor}", relative)
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def _interop_of(path: Path | None, source: str) -> dict[str, Any] | None:
    """The interop section of the JIR file `path` if it matches `source` (jaclang's key check)."""
    from jaclang.jac0core.jir import HEADER_SIZE, SEC_INTEROP, SECTIONS_MAGIC, jir_matches_source, read_sections

    if path is None or not path.is_file():
        return None
    data = path.read_bytes()
    if not jir_matches_source(data, source):
        return None
    start = data.find(SECTIONS_MAGIC, HEADER_SIZE)
    if start < 0:
        return None
    section = read_sections(data, start + len(SECTIONS_MAGIC)).get(SEC_INTEROP)
    return json.loads(section.decode("utf-8")) if section is not None else None


def _interop(source: str) -> dict[str, Any] | None:
    """The interop section for `source`: from its module cache file (written by a compile), else
    from the precompiled bundle's file (the module cache then holds jaclang's copy of the bundle's
    bytecode, without the section; setup.py adds the section to the bundle); None if neither
    matches `source` or carries one."""
    from jaclang.jac0core.jir import get_module_cache_path

    found = _interop_of(get_module_cache_path(source), source)
    return found if found is not None else _interop_of(_bundle_file(source), source)


def _sources(module: Any) -> list[str]:
    """The entry module's file, then the `.jac` files of the modules its names come from."""
    main = os.path.abspath(module.__file__)
    found = [main]
    for value in vars(module).values():
        name = getattr(value, "__module__", None) or ""
        if name.split(".")[0] == "jaclang":
            continue  # jaclang's builtins (`jobj`...), put in every module's namespace, not imported
        provider = sys.modules.get(name)
        path = getattr(provider, "__file__", None) or ""
        if path.endswith(".jac") and os.path.abspath(path) not in found:
            found.append(os.path.abspath(path))
    return found


FALLBACK = "access levels not read from the compile cache"


def _refuse(reason: str) -> None:
    logger.warning("%s (%s): jaclang compiles the modules to read them", FALLBACK, reason)


def cached_tables(module: Any) -> dict[str, dict] | None:
    """{"walker_access", "func_access", "endpoint_effects"} unioned as jaclang does (the entry
    module first, so its names win), or None (with a warning) where the cache cannot be trusted."""
    path = getattr(module, "__file__", None)
    if not (path and path.endswith(".jac")) or not pinned():
        return None
    if os.path.exists(path.removesuffix(".jac") + ".cl.jac"):
        return _refuse("the entry module has a client part")
    tables: dict[str, dict] = {"walker_access": {}, "func_access": {}, "endpoint_effects": {}}
    sources = _sources(module)
    for source in sources:
        interop = _interop(source)
        if interop is None:
            return _refuse(f"no cache or bundle file with a table matching {source}")
        if interop.get("bindings"):
            return _refuse(f"{source} has client/server bindings")
        if not (interop.get("walker_access") or interop.get("func_access")) and source != sources[0]:
            return _refuse(f"{source} has no table")  # jaclang would run its boundary analysis on it
        for key in ("walker_access", "func_access"):
            for (name, auth) in interop.get(key, {}).items():
                tables[key].setdefault(name, bool(auth))
        tables["endpoint_effects"].update(interop.get("endpoint_effects", {}))
    return tables


def use_cached_tables(introspector: Any) -> None:
    """Make `introspector` (jaclang's ModuleIntrospector) read its tables from the cache when it
    can; the methods of its own class run otherwise."""
    if not pinned() or os.environ.get("CONTEXTRENDER_ACCESS_FROM_CACHE", "1") == "0":
        return
    base = type(introspector)

    class CachedAccessIntrospector(base):  # type: ignore[misc, valid-type]
        def _load_manifest(self) -> None:
            try:
                tables = cached_tables(self._module)
            except Exception as error:  # anything unexpected: jaclang's own path
                tables = _refuse(f"{type(error).__name__}: {error}")
            self._cached_tables = tables
            if tables is None:
                return base._load_manifest(self)
            self._client_manifest = {"endpoint_effects": dict(tables["endpoint_effects"])}

        def _extract_access_levels(self) -> None:
            tables = getattr(self, "_cached_tables", None)
            if tables is None:
                return base._extract_access_levels(self)
            self._walker_access = dict(tables["walker_access"])
            self._function_access = dict(tables["func_access"])

    introspector.__class__ = CachedAccessIntrospector
