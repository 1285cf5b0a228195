"""The per-invocation ``Call`` object handed to the wrapped function, and its injection.

A parameter annotated ``Call`` (or ``Call | None``) receives the live object;
it tells the function which restart iteration it is in, lets it report
progress (``ping``) and fence code the restart must not cut (``atomic``).
"""

from __future__ import annotations

import contextlib
import inspect
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

from torch._C._distributed_c10d import Store

from .monitor_thread import AtomicGate
from .progress import ProgressClock
from .state import Mode, State


class Call:
    """State of one invocation of a wrapped function (one per call, all iterations)."""

    def __init__(
        self,
        state: State,
        clock: ProgressClock | None = None,
        gate: AtomicGate | None = None,
        store: Store | None = None,
    ) -> None:
        self._state = state
        self._clock = clock
        self._gate = gate or AtomicGate()
        self._store = store

    def _advance(self, state: State, store: Store | None) -> None:
        self._state = state
        self._store = store

    @property
    def iteration(self) -> int:
        """Restart count: 0 on the first entry, +1 on every re-entry."""
        return self._state.iteration

    @property
    def rank(self) -> int:
        """This rank's number in the current iteration (after reassignment)."""
        return self._state.rank

    @property
    def world_size(self) -> int:
        """Number of active ranks in the current iteration."""
        return self._state.world_size

    @property
    def initial_rank(self) -> int:
        return self._state.initial_rank

    @property
    def active(self) -> bool:
        return self._state.mode is Mode.ACTIVE

    @property
    def store(self) -> Store | None:
        """A fresh per-iteration store for ``init_process_group(store=..., rank=..., world_size=...)``."""
        return self._store

    def ping(self) -> None:
        """Report progress; from the first ping of an iteration, the soft/hard timeouts apply."""
        if self._clock is not None:
            self._clock.ping()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A block a restart cannot cut: the restart waits until the block exits."""
        self._gate.enter()
        try:
            yield
        finally:
            self._gate.exit()


# NVIDIA's ``inprocess`` calls this class ``CallWrapper``: both spellings inject.
CallWrapper = Call

_CALL_SPELLINGS = frozenset(
    spelling
    for name in ("Call", "CallWrapper")
    for spelling in (
        name,
        f"{name}|None",
        f"None|{name}",
        f"Optional[{name}]",
        f"typing.Optional[{name}]",
    )
)


def _is_call_annotation(hint: Any) -> bool:
    if isinstance(hint, str):
        # Unresolvable string annotation (``from __future__ import annotations`` with
        # ``Call`` imported in a local scope): match the spelling.
        text = hint.replace(" ", "").replace("stalwart.inprocess.", "").replace("inprocess.", "")
        return text in _CALL_SPELLINGS
    if hint is Call:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args == [Call]
    return False


def inject_call(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], call: Call
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Pass ``call`` for every parameter annotated with ``Call``."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = dict(getattr(fn, "__annotations__", {}))
    names = [n for n, h in hints.items() if n != "return" and _is_call_annotation(h)]
    if not names:
        return args, kwargs
    sig = inspect.signature(fn)
    bound = sig.bind_partial(*args, **kwargs)
    for name in names:
        bound.arguments[name] = call
    return bound.args, bound.kwargs
