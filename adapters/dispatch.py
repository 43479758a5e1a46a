"""jaclang's runtime calls with their arguments bound once per call instead of by `inspect`.

Every runtime operation a Jac program makes (`connect`, `visit`, `spawn`, the access checks,
`save`, `get_context`, ...) is a method of jaclang's `JacRuntimeInterface`, which jaclang turns
into a proxy (`generate_plugin_helpers`): each call binds its arguments to the method's
signature with `inspect.Signature.bind_partial` and `apply_defaults`, then calls the hook of that
name with them as keywords, so that any plugin can answer it. A tool round of ingestion makes
about 85 such calls; their binding was a fifth of a long ingestion's samples, and binding them
from a plan cut its CPU time by about 16 % (docs/performance.md, "Issue 30, second round").

`install()` gives each proxy the same binding made from a plan worked out once from the same
signature: the positional arguments named in order, the keywords added, the missing parameters
that have defaults filled with them, in the signature's order. That is what `bind_partial` and
`apply_defaults` make for every call that binds; anything else (an unknown or repeated keyword,
too many positional arguments, a signature with `*args`, `**kwargs` or positional-only
parameters, a coroutine) goes to jaclang's own proxy, which raises as before. The hooks are
called as jaclang calls them, so plugins (jac-scale's, ours) answer as before. Nothing in
jaclang is edited: the proxies are replaced on the class and in the modules that imported them
(compiled Jac modules import them by name from `jaclang.lib`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from types import FunctionType
from typing import Any

__all__ = ["install", "lean_proxy", "is_jaclang_proxy"]

_PROXY_NAME = "generate_plugin_helpers.<locals>.make_proxy.<locals>.proxy"
_PLAIN = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)

# Original proxy -> its lean one, once installed (a second install changes nothing).
_LEAN: dict[Callable[..., Any], Callable[..., Any]] = {}


def is_jaclang_proxy(function: Any) -> bool:
    """Whether `function` is one of jaclang's generated (synchronous) runtime proxies."""
    return inspect.isfunction(function) and function.__qualname__ == _PROXY_NAME and hasattr(function, "__signature__")


def lean_proxy(name: str, original: Callable[..., Any]) -> Callable[..., Any] | None:
    """A proxy for jaclang's runtime method `name` that binds as `original` does (its signature)
    and calls the same hook; None when the signature has parameters the plan does not cover."""
    from jaclang.jac0core.runtime import plugin_manager

    signature: inspect.Signature = original.__signature__  # type: ignore[attr-defined]
    parameters = list(signature.parameters.values())
    if any(p.kind not in _PLAIN for p in parameters):
        return None
    names = tuple(p.name for p in parameters)
    positional = tuple(p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    # The parameters after the first k positional arguments, for each k: the ones a keyword or
    # a default may fill.
    rest = [names[k:] for k in range(len(positional) + 1)]
    hooks = plugin_manager.hook

    def proxy(*args: object, **kwargs: object) -> object:
        count = len(args)
        if count > len(positional):
            return original(*args, **kwargs)
        arguments = dict(zip(positional, args))
        later = rest[count]
        if kwargs:
            if not kwargs.keys() <= set(later):
                return original(*args, **kwargs)  # a repeated or unknown keyword: jaclang's TypeError
            for key in later:
                if key in kwargs:
                    arguments[key] = kwargs[key]
                elif key in defaults:
                    arguments[key] = defaults[key]
        else:
            for key in later:
                if key in defaults:
                    arguments[key] = defaults[key]
        return getattr(hooks, name)(**arguments)

    proxy.__name__ = name
    proxy.__qualname__ = f"lean_proxy.<{name}>"
    proxy.__signature__ = signature  # type: ignore[attr-defined]
    proxy.__wrapped_proxy__ = original  # type: ignore[attr-defined]
    return proxy


def install() -> int:
    """Replace jaclang's runtime proxies with lean ones, on `JacRuntimeInterface` and wherever a
    loaded module holds one by name; returns how many proxies are lean. Safe to call again (a
    module loaded since is updated too)."""
    from jaclang.jac0core.runtime import JacRuntimeInterface

    for (name, function) in list(vars(JacRuntimeInterface).items()):
        if is_jaclang_proxy(function) and function not in _LEAN:
            lean = lean_proxy(name, function)
            if lean is not None:
                _LEAN[function] = lean
                setattr(JacRuntimeInterface, name, lean)
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for (key, value) in list(namespace.items()):
            if type(value) is FunctionType and value in _LEAN:
                namespace[key] = _LEAN[value]
    return len(_LEAN)
