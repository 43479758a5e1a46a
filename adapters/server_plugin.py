"""The jaclang plugin that `jac start` loads (the `server` entry point of the `jac` group in
pyproject.toml): ContextRender's server class (adapters/server.py). jaclang loads that group
whenever it is imported, so this module imports nothing heavy of its own. jaclang asks the last
plugin registered first, so jac-scale's plugin is imported (registered) here before this one,
whatever order the entry points come in; where jac-scale is not installed (an install without
the `server` extra) or its plugin is disabled in this process, this plugin adds nothing and
imports nothing. Processes that import ContextRender before jaclang (the engine in-process, the
proxy, a replay) disable both (adapters/jac_plugins.py)."""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from jaclang.jac0core.runtime import hookimpl

from contextrender_adapters.jac_plugins import user_disabled

# jaclang's own names for jac-scale's server plugin (the `scale` entry point, jac_scale.plugin).
_SCALE_OFF = {"*", "jac-scale:*", "jac-scale:scale", "scale"}
HAS_SERVER = find_spec("jac_scale") is not None and not _SCALE_OFF & set(user_disabled())
if HAS_SERVER:
    import jac_scale.plugin  # noqa: F401


class ServerPlugin:
    if HAS_SERVER:
        @staticmethod
        @hookimpl
        def get_api_server_class() -> Any:
            from contextrender_adapters.server import server_class

            return server_class()
