"""jaclang's runtime calls bound without `inspect` (adapters/dispatch.py): every lean proxy hands
its hook exactly the arguments jaclang's own proxy binds (`bind_partial` and `apply_defaults`),
in the same order, and calls jaclang's proxy for whatever it does not bind itself."""

from __future__ import annotations

import inspect

import pytest

from contextrender import core  # noqa: F401  (imports jaclang, which installs the lean proxies)
from contextrender import dispatch


def _runtime() -> type:
    from jaclang.jac0core.runtime import JacRuntimeInterface

    return JacRuntimeInterface


def _lean_proxies() -> dict[str, object]:
    return {name: f for (name, f) in vars(_runtime()).items() if getattr(f, "__wrapped_proxy__", None) is not None}


def test_every_runtime_proxy_jaclang_made_is_lean_after_import():
    left = [name for (name, f) in vars(_runtime()).items() if dispatch.is_jaclang_proxy(f)]
    lean = _lean_proxies()
    assert len(lean) > 50, "the runtime's operations (connect, visit, spawn, the access checks) are lean"
    assert {"connect", "visit", "spawn", "save", "check_access_level", "get_context"} <= set(lean)
    # Only signatures the plan does not cover keep jaclang's proxy.
    for name in left:
        kinds = {p.kind for p in inspect.signature(vars(_runtime())[name]).parameters.values()}
        assert kinds - {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY}, name
    # The compiled Jac modules call the lean ones (they import them by name from jaclang.lib).
    import jaclang.lib
    import walkers.ingest

    assert walkers.ingest.connect is lean["connect"] and jaclang.lib.connect is lean["connect"]
    assert dispatch.install() == len(dispatch._LEAN)  # again: nothing more to replace


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple[str, object]]]] = []

    def __getattr__(self, name: str):
        def hook(**arguments: object) -> str:
            self.calls.append((name, list(arguments.items())))
            return "answered"

        return hook


def _calls_for(signature: inspect.Signature) -> list[tuple[tuple, dict]]:
    """Argument lists a caller may pass: every count of positional arguments, and keywords for
    the rest (each alone and all together), including ones that do not bind."""
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    out: list[tuple[tuple, dict]] = []
    for k in range(len(positional) + 2):
        args = tuple(f"a{i}" for i in range(k))
        out.append((args, {}))
        later = [p.name for p in params[k:]]
        for name in later:
            out.append((args, {name: f"kw-{name}"}))
        out.append((args, {name: f"kw-{name}" for name in later}))
        out.append((args, {"not_a_parameter": 1}))
        if k and params:
            out.append((args, {params[0].name: "twice"}))
    return out


def test_lean_proxies_bind_as_jaclang_binds(monkeypatch: pytest.MonkeyPatch):
    from jaclang.jac0core.runtime import plugin_manager

    recorder = _Recorder()
    monkeypatch.setattr(plugin_manager, "hook", recorder)
    checked = 0
    for (name, original) in dispatch._LEAN.items():
        lean = dispatch.lean_proxy(original.__name__, original)  # bound to the recording hooks
        signature = original.__signature__
        for (args, kwargs) in _calls_for(signature):
            try:
                bound = signature.bind_partial(*args, **kwargs)
            except TypeError:
                with pytest.raises(TypeError):
                    lean(*args, **kwargs)
                continue
            bound.apply_defaults()
            recorder.calls.clear()
            assert lean(*args, **kwargs) == "answered"
            assert recorder.calls == [(original.__name__, list(bound.arguments.items()))], (original.__name__, args, kwargs)
            checked += 1
    assert checked > 500


def test_a_signature_with_star_args_keeps_jaclangs_proxy():
    def proxy(*args: object, **kwargs: object) -> object:
        return None

    proxy.__signature__ = inspect.signature(lambda a, *rest, **more: None)
    assert dispatch.lean_proxy("anything", proxy) is None
