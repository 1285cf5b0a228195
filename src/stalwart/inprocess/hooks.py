"""Hook composition and the call shapes the wrapper expects of user hooks.

The shapes are NVIDIA ``inprocess``'s, so hooks written for it run unchanged:
``initialize(state) -> state``, ``abort(state) -> state``,
``finalize(state, exception)``, ``health_check(state, exception)``,
``rank_assignment(state, terminated) -> (state, terminated)`` and
``rank_filter(state) -> state``; 0.4's one-argument ``finalize(state)``,
``health_check(state)`` and ``rank_assignment(ctx) -> ctx`` too.  A hook that returns ``None`` where a state is
expected leaves the state as it was.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .errors import ConfigError

# How many positional arguments the wrapper can pass to each hook, the preferred first:
# NVIDIA 0.2's shapes, then 0.4's one-argument ``finalize(state)``,
# ``health_check(state)`` and ``rank_assignment(ctx)``.
HOOK_ARITY = {
    "initialize": (1,),
    "abort": (1,),
    "finalize": (2, 1),
    "health_check": (2, 1),
    "rank_assignment": (2, 1),
    "rank_filter": (1,),
}
_EXPECTED = {
    "initialize": "(state) -> state",
    "abort": "(state) -> state",
    "finalize": "(state, exception) or finalize(state)",
    "health_check": "(state, exception) or health_check(state)",
    "rank_assignment": "(state, terminated) -> (state, terminated) or rank_assignment(ctx) -> ctx",
    "rank_filter": "(state) -> state",
}


def hook_arity(name: str, hook: Any) -> int | None:
    """How many arguments to pass ``hook`` (the first of its kind's shapes it can take),
    None when it takes none of them; a C callable without a signature gets the first."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return HOOK_ARITY[name][0]
    for arity in HOOK_ARITY[name]:
        try:
            signature.bind(*([None] * arity))
        except TypeError:
            continue
        return arity
    return None


def call_hook(name: str, hook: Callable[..., Any], *args: Any) -> Any:
    """Call a hook with as many of the wrapper's arguments as its shape takes."""
    arity = hook_arity(name, hook)
    return hook(*args[: arity if arity is not None else len(args)])


def check_hook(name: str, hook: Any) -> None:
    """Raise ``ConfigError`` now for a hook that could not take the wrapper's arguments.

    Without this a ``finalize`` of the wrong shape would fail with ``TypeError`` at the
    first restart, long after the job started.
    """
    if hook is None:
        return
    if not callable(hook):
        raise ConfigError(f"{name} must be callable or None, got {hook!r}")
    if hook_arity(name, hook) is None:
        raise ConfigError(
            f"{name} must be callable as {name}{_EXPECTED[name]}, "
            f"got {hook!r} with signature {inspect.signature(hook)}"
        )


class Compose:
    """Chain hooks of one kind into one: ``Compose(a, b, c)(x)`` is ``a(b(c(x)))``.

    As in NVIDIA's ``inprocess.Compose``, the last hook runs first and each
    result feeds the next hook: a tuple is spread into its arguments (so
    ``health_check`` and ``rank_assignment`` chains pass ``(state, x)`` along),
    any other value becomes the single argument.  Unlike there, a hook that
    returns ``None`` passes its own arguments on unchanged, so hooks that only
    act (``finalize``) chain without each having to return what it received.
    """

    def __new__(cls, *hooks: Callable[..., Any]) -> Compose:
        # As NVIDIA's: the chain is also an instance of the nearest class all its hooks
        # share (Compose(a, b) of two ``Finalize`` subclasses is a ``Finalize``), so code
        # that checks a hook's type accepts it.  Plain functions share no such class.
        base = _shared_class(hooks)
        if cls is Compose and base is not None:
            try:
                return super().__new__(_chain_class(base))
            except TypeError:  # a final or abstract class cannot be one: a plain chain
                pass
        return super().__new__(cls)

    def __init__(self, *hooks: Callable[..., Any]) -> None:
        if not hooks:
            raise ConfigError("Compose needs at least one hook")
        for hook in hooks:
            if not callable(hook):
                raise ConfigError(f"Compose takes callables, got {hook!r}")
        self.hooks = hooks

    def __call__(self, *args: Any) -> Any:
        result: Any = None
        for hook in reversed(self.hooks):
            result = hook(*args)
            if result is None:
                continue
            args = result if isinstance(result, tuple) else (result,)
        if result is None and len(args) == 1:
            return args[0]
        return result if result is not None else (args or None)

    def __repr__(self) -> str:
        return f"Compose({', '.join(repr(h) for h in self.hooks)})"


def _shared_class(hooks: tuple[Any, ...]) -> type | None:
    """The nearest class in the first hook's MRO that every hook is an instance of,
    when it is a class of the program's (not ``object`` or a built-in one)."""
    if not hooks:
        return None
    for klass in type(hooks[0]).__mro__:
        if klass is object or klass.__module__ == "builtins":
            return None
        if getattr(klass, "_is_protocol", False) or klass.__module__ == "typing":
            continue  # our hook protocols: a shape, not a class to be an instance of
        if all(isinstance(h, klass) for h in hooks):
            return klass
    return None


def _chain_class(base: type) -> type[Compose]:
    return type(f"Compose[{base.__qualname__}]", (Compose, base), {})
