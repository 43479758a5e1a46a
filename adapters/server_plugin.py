"""The jaclang plugin that `jac start` loads (the `server` entry point of the `jac` group in
pyproject.toml): ContextRender's server class (adapters/server.py). jaclang loads that group
whenever it is imported, so this module imports nothing heavy, and without jac-scale (an install
without the `server` extra: the in-process engine, the client, the proxy) it adds nothing."""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from jaclang.jac0core.runtime import hookimpl

HAS_SERVER = find_spec("jac_scale") is not None
if HAS_SERVER:
    # jac-scale's own plugin first, so that ours is registered after it and its server class wins
    # whatever order the entry points are found in.
    import jac_scale.plugin  # noqa: F401


class ServerPlugin:
    if HAS_SERVER:
        @staticmethod
        @hookimpl
        def get_api_server_class() -> Any:
            from contextrender_adapters.server import server_class

            return server_class()
