"""ContextRender's server class for `jac start`, registered by the server entry (contextrender.jac)
as a jaclang plugin: `jac start` asks for its server class after it has imported the entry, and
jaclang asks the last plugin registered first, so ours (adapters/server/app.py) answers before
jac-scale's. Where jac-scale is not installed (an install without the `server` extra) or its plugin
is disabled in this process, nothing is registered and nothing heavy imported.

Registered from the entry rather than as an entry point of jaclang's `jac` group: jaclang loads
that group while it is itself being imported, before `jac start` has imported the entry, and the
plugin's module would make `contextrender` the Python package in a process where it has to be the
entry (docs/design-decisions.md, "One name, two faces")."""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from jaclang.jac0core.runtime import hookimpl, plugin_manager

from contextrender.jaclang_setup import user_disabled

__all__ = ["HAS_SERVER", "ServerPlugin", "register_server"]

# jaclang's own names for jac-scale's server plugin (the `scale` entry point, jac_scale.plugin).
_SCALE_OFF = {"*", "jac-scale:*", "jac-scale:scale", "scale"}
HAS_SERVER = find_spec("jac_scale") is not None and not _SCALE_OFF & set(user_disabled())


class ServerPlugin:
    @staticmethod
    @hookimpl
    def get_api_server_class() -> Any:
        from contextrender.server.app import server_class

        return server_class()

    @staticmethod
    @hookimpl
    def get_persistent_memory(config: dict) -> Any:
        """The SQLite store with a busy timeout and short commits (adapters/store.py); with MongoDB
        configured, jac-scale's backend writing a call's documents in bulk (bulk_mongo.py), or
        nothing where MongoDB does not answer (jac-scale then falls back as it does)."""
        from contextrender.store import StorePlugin, mongodb_configured

        if not config.get("db_path") and mongodb_configured():
            from contextrender.server.bulk_mongo import BulkMongoBackend

            backend = BulkMongoBackend()
            return backend if backend.is_available() else None
        return StorePlugin.get_persistent_memory(config)

    @staticmethod
    @hookimpl
    def create_j_context(user_root: str | None, base_path_dir: str | None = None,
                         full_target_path: str | None = None) -> Any:
        """jac-scale's request context, its working set's commit without hashing new anchors
        (adapters/working_set.py `server_memory_class`: about a third of a big call's time, in which it
        could not give way to the others), and its close freeing a big working set in slices
        (adapters/server/teardown.py: otherwise one full collection that holds every call)."""
        from jac_scale.memory_hierarchy import ScaleTieredMemory
        from jac_scale.plugin import JacScalePlugin

        from contextrender.server.teardown import untied_on_close
        from contextrender.working_set import server_memory_class

        ctx = JacScalePlugin.create_j_context(user_root, base_path_dir, full_target_path)
        if type(ctx.mem) is ScaleTieredMemory:
            ctx.mem.__class__ = server_memory_class()
            untied_on_close(ctx.mem)
        return ctx

    @staticmethod
    @hookimpl
    def spawn_call(walker: Any, nd: Any) -> Any:
        """Nothing (jaclang's own spawn answers): the walker is noted on a server request's working
        set, whose close empties it with a big call's anchors (adapters/server/teardown.py)."""
        from contextrender.server.teardown import note_walker

        note_walker(walker)
        return None

    @staticmethod
    @hookimpl
    def get_user_manager(base_path: str) -> Any:
        """jac-scale's user manager with tokens that end and a password minimum (accounts.py)."""
        from contextrender.server.accounts import user_manager_class

        return user_manager_class()(base_path=base_path)


def register_server() -> bool:
    """Register ServerPlugin with jaclang (once) where jac-scale serves; whether it is registered."""
    if not HAS_SERVER:
        return False
    import jac_scale.plugin  # noqa: F401  (jac-scale's hook registered before ours, so ours answers first)

    if not plugin_manager.is_registered(ServerPlugin):
        plugin_manager.register(ServerPlugin)
    return True
