"""adapters/server/access_table.py: `jac start` reads the walkers' access levels from jaclang's compile
cache; every route is served with the same login requirement and request fields as when jaclang
compiles the entry module from source to read them (CONTEXTRENDER_ACCESS_FROM_CACHE=0)."""

from __future__ import annotations

import httpx

from contextrender.server import access_table
from jacserver import JacServer


def routes(openapi: dict) -> dict[tuple[str, str], tuple[bool, list[str]]]:
    """(path, method) -> (needs a login, the request body's field names): jac-scale numbers its
    body schemas in registration order, so the schemas are compared by content, not by name."""
    schemas = openapi.get("components", {}).get("schemas", {})
    found = {}
    for path, methods in openapi["paths"].items():
        for method, operation in methods.items():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
            ref = body.get("schema", {}).get("$ref", "")
            fields = sorted(schemas.get(ref.rsplit("/", 1)[-1], {}).get("properties", {})) if ref else []
            found[(path, method)] = (bool(operation.get("security")), fields)
    return found


def test_the_versions_it_reads_are_the_pinned_ones():
    assert access_table.pinned()


def test_access_levels_from_the_cache_are_those_of_a_compile(tmp_path):
    server = JacServer(tmp_path / "served")
    seen = {}
    for mode in ("0", "1"):  # a compile from source (which also fills the cache), then the cache
        server.env["CONTEXTRENDER_ACCESS_FROM_CACHE"] = mode
        server.start()
        try:
            seen[mode] = routes(httpx.get(f"{server.url}/openapi.json", timeout=30).json())
        finally:
            server.stop()
    assert access_table.FALLBACK not in server.log.read_text()  # the second start read the cache
    assert seen["1"] == seen["0"]
    walkers = {path: auth for ((path, _), (auth, _)) in seen["1"].items() if path.startswith("/walker/")}
    assert walkers["/walker/health"] is False
    assert len(walkers) >= 10 and all(auth for (path, auth) in walkers.items() if path != "/walker/health")


def test_a_stale_or_missing_cache_falls_back(tmp_path, caplog):
    source = tmp_path / "entry.jac"
    source.write_text('walker :pub hello { can go with Root entry { report 1; } }\n')

    class Module:
        __file__ = str(source)

    with caplog.at_level("WARNING", logger="contextrender.server"):
        assert access_table.cached_tables(Module) is None  # never compiled: no cache file
    assert access_table.FALLBACK in caplog.text and str(source) in caplog.text
    Module.__file__ = str(tmp_path / "entry.py")
    assert access_table.cached_tables(Module) is None  # not a Jac module


def test_a_wheel_bundle_file_gives_the_table_when_the_module_cache_has_none(tmp_path):
    """A wheel's modules load from its `_precompiled/` bundle, whose files setup.py gives the
    interop section; the table is read there, and only while the file matches its source."""
    import json
    import sys

    from jaclang.jac0core.jir import (
        HEADER_SIZE, SEC_INTEROP, SECTIONS_MAGIC, compute_module_key, read_sections, write_precompiled_jir, write_sections,
    )

    source = tmp_path / "package" / "walkers" / "hello.jac"
    source.parent.mkdir(parents=True)
    source.write_text('walker :pub hello { can go with Root entry { report 1; } }\n')
    bundle = tmp_path / "package" / "_precompiled" / f"cpython-{sys.version_info.major}{sys.version_info.minor}" / "walkers" / "hello.jir"
    bundle.parent.mkdir(parents=True)
    table = {"walker_access": {"hello": False}, "func_access": {}, "endpoint_effects": {}}
    data = write_precompiled_jir(b"", compute_module_key(str(source)), 0)
    start = data.find(SECTIONS_MAGIC, HEADER_SIZE)
    sections = read_sections(data, start + len(SECTIONS_MAGIC)) | {SEC_INTEROP: json.dumps(table).encode()}
    bundle.write_bytes(data[:start] + write_sections(sections))
    assert access_table._bundle_file(str(source)) == bundle
    assert access_table._interop(str(source)) == table
    source.write_text('walker hello { can go with Root entry { report 2; } }\n')  # the bundle is now stale
    assert access_table._interop(str(source)) is None
