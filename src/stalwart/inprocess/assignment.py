"""Rank assignment (who gets which rank after ranks were terminated) and rank filters
(which ranks call the function, which wait as spares).

Both are pure functions of the ``State`` and the authoritative terminated set,
so every rank computes the same answer without talking to the others.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from collections.abc import Callable, Mapping, Set
from datetime import timedelta
from typing import Any, Protocol, overload

from .errors import InternalError, RankDiscarded, RestartError
from .hooks import hook_arity
from .state import Mode, State


class RankAssignment(Protocol):
    """Places this rank for the next iteration given the ranks terminated since the last one.

    NVIDIA ``inprocess``'s contract: ``state.rank``/``state.world_size`` are the numbers
    the last assignment gave (before any rank filter), ``terminated`` names ranks in that
    same numbering, and a terminated rank's own call raises ``RankDiscarded``.  Returns
    ``(state, terminated)``: the second item is the terminated ranks this assignment did
    not account for, which must be empty (the wrapper raises ``RestartError`` otherwise);
    composed assignments pass it along.  With ``Wrapper(rank_numbering="initial")`` the
    numbers given are the initial ones and ``terminated`` every rank gone so far.
    """

    def __call__(self, state: State, terminated: Set[int], /) -> tuple[State, Set[int]]: ...


@dataclasses.dataclass
class RankAssignmentCtx:
    """NVIDIA ``inprocess`` 0.4's one-argument form of a rank assignment's input and
    output: ``state`` as in the two-argument form, ``terminated_ranks`` the ranks still
    to be accounted for, and ``store`` whatever the caller hands on (the built-in
    assignments never read it)."""

    state: State
    store: object
    terminated_ranks: Set[int]


Placement = Callable[[State, Set[int]], tuple[State, Set[int]]]


def _either_form(
    place: Placement, first: State | RankAssignmentCtx, terminated: Set[int] | None
) -> tuple[State, Set[int]] | RankAssignmentCtx:
    """Apply a two-argument placement to whichever form it was called with, answering
    in that form."""
    if isinstance(first, RankAssignmentCtx):
        if terminated is not None:
            raise TypeError("a RankAssignmentCtx comes alone, without a terminated set")
        state, rest = place(first.state, set(first.terminated_ranks))
        return RankAssignmentCtx(state, first.store, set(rest))
    if terminated is None:
        raise TypeError("rank assignment needs (state, terminated) or (RankAssignmentCtx)")
    return place(first, terminated)


def call_assignment(
    assignment: Callable[..., object], state: State, terminated: Set[int], store: object
) -> tuple[State, Set[int]]:
    """Run a rank assignment of either form; ``(state, unaccounted)``, or
    ``InternalError`` naming what it returned instead."""
    if hook_arity("rank_assignment", assignment) == 1:
        out = assignment(RankAssignmentCtx(state, store, set(terminated)))
        if not (isinstance(out, RankAssignmentCtx) and isinstance(out.state, State)):
            raise InternalError(
                f"rank_assignment must return a RankAssignmentCtx, got {type(out).__name__}"
            )
        return out.state, set(out.terminated_ranks)
    result = assignment(state, terminated)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], State)):
        raise InternalError(
            f"rank_assignment must return (state, terminated), got {type(result).__name__}"
        )
    return result[0], set(result[1])


class RankFilter(Protocol):
    """Marks a rank active or inactive for the next iteration."""

    def __call__(self, state: State) -> State: ...


def assignment_input(
    numbering: str,
    state: State,
    last: tuple[int, int],
    terminated: frozenset[int],
    accounted: frozenset[int],
    last_numbers: Mapping[int, int],
) -> tuple[State, set[int]]:
    """What the rank assignment is given: ``state`` carrying the numbers to place from,
    and the terminated ranks in those numbers.

    ``last`` is (rank, world size) as the previous assignment gave them; ``terminated``
    the initial ranks gone so far, ``accounted`` those the previous assignment was told
    of, ``last_numbers`` the previous numbers of the newly terminated ones.  Under
    "initial", every rank places itself from its initial numbers and everyone gone.
    """
    if numbering == "initial":
        start = dataclasses.replace(
            state, rank=state.initial_rank, world_size=state.initial_world_size
        )
        return start, set(terminated)
    fresh = terminated - accounted
    unknown = sorted(fresh - last_numbers.keys())
    if unknown:
        # Placing the others without their numbers could give two ranks one number.
        raise RestartError(
            f"initial ranks {unknown} left before their last rank was recorded: "
            "the survivors cannot renumber consistently"
        )
    start = dataclasses.replace(state, rank=last[0], world_size=last[1])
    return start, {last_numbers[r] for r in fresh}


def discarded_by(placed: State, terminated: frozenset[int]) -> frozenset[int]:
    """The initial ranks an assignment added to ``state.terminated`` beyond the
    wrapper's own ``terminated`` (those it terminated itself), kept to real ranks."""
    return (
        frozenset(r for r in placed.terminated if 0 <= r < placed.initial_world_size) - terminated
    )


def function_view(state: State) -> State:
    """The numbers the function sees: an assignment that numbers every live rank in
    ``rank`` and the active ones in ``active_rank`` (NVIDIA 0.4's ``Tree``) hands the
    function ``active_rank`` of ``active_world_size``; any other is taken as it is."""
    if state.active_rank is None:
        return state
    return dataclasses.replace(state, rank=state.active_rank, world_size=state.active_world_size)


def _discard_if_terminated(state: State, terminated: Set[int]) -> None:
    if state.rank in terminated:
        raise RankDiscarded(
            f"rank {state.rank} of {state.world_size} is among the terminated ranks "
            f"{sorted(terminated)}"
        )


def _renumbered(state: State, rank: int, world_size: int) -> tuple[State, Set[int]]:
    placed = dataclasses.replace(
        state, rank=rank, world_size=world_size, active_world_size=world_size
    )
    return placed, set()


class _Renumbering:
    """Both renumbering policies take either call form; each supplies ``_place``."""

    @overload
    def __call__(self, state: RankAssignmentCtx, /) -> RankAssignmentCtx: ...
    @overload
    def __call__(self, state: State, terminated: Set[int], /) -> tuple[State, Set[int]]: ...
    def __call__(
        self, state: State | RankAssignmentCtx, terminated: Set[int] | None = None, /
    ) -> tuple[State, Set[int]] | RankAssignmentCtx:
        return _either_form(self._place, state, terminated)

    @staticmethod
    def _place(state: State, terminated: Set[int]) -> tuple[State, Set[int]]:
        raise NotImplementedError


class ShiftRanks(_Renumbering):
    """Survivors keep their order and close the gaps: each rank moves down by the number
    of terminated ranks below it; the world size shrinks by the number terminated.

    Called as ``(state, terminated)`` or, as NVIDIA 0.4's, with one ``RankAssignmentCtx``.
    """

    @staticmethod
    def _place(state: State, terminated: Set[int]) -> tuple[State, Set[int]]:
        _discard_if_terminated(state, terminated)
        below = sum(1 for r in terminated if r < state.rank)
        return _renumbered(state, state.rank - below, state.world_size - len(terminated))

    def __repr__(self) -> str:
        return "ShiftRanks()"


class FillGaps(_Renumbering):
    """Survivors below the new world size keep their rank; the ones at or above it take
    the terminated ranks below it, in order (the lowest mover the lowest gap).

    Fewer ranks change number than with ``ShiftRanks``.  NVIDIA's hands the movers the
    terminated ranks in order whether or not they are below the new world size, so two
    terminated ranks at the top give a mover a rank the new world does not have
    (docs/migrating.md); here a mover only ever takes a gap.  Called in either form, as
    ``ShiftRanks``.
    """

    @staticmethod
    def _place(state: State, terminated: Set[int]) -> tuple[State, Set[int]]:
        _discard_if_terminated(state, terminated)
        size = state.world_size - len(terminated)
        rank = state.rank
        if rank >= size:
            gaps = sorted(r for r in terminated if r < size)
            movers = [r for r in range(size, state.world_size) if r not in terminated]
            rank = gaps[movers.index(rank)]
        return _renumbered(state, rank, size)

    def __repr__(self) -> str:
        return "FillGaps()"


class ActiveWorldSize:
    """The first ``size`` ranks are active, the rest are spares.

    With ``ShiftRanks`` this makes a spare take a vanished rank's place: the
    survivors shift down and the lowest spare crosses into the active range.
    ``world_size`` seen by active ranks is the active count.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("active world size must be >= 1")
        self.size = size

    def __call__(self, state: State) -> State:
        if state.mode is Mode.TERMINATED:
            return state
        active = min(self.size, state.world_size)
        mode = Mode.ACTIVE if state.rank < active else Mode.INACTIVE
        return dataclasses.replace(state, mode=mode, active_world_size=active, world_size=active)

    def __repr__(self) -> str:
        return f"ActiveWorldSize({self.size})"


def _keep_active(state: State, active: int) -> State:
    """The first ``active`` ranks call the function; the rest wait as spares."""
    if state.mode is Mode.TERMINATED:
        return state
    mode = Mode.ACTIVE if state.rank < active else Mode.INACTIVE
    return dataclasses.replace(state, mode=mode, active_world_size=active, world_size=active)


class MaxActiveWorldSize:
    """NVIDIA's filter by that name: at most ``max_active_world_size`` ranks active.

    ``None`` means no limit (every placed rank is active), as NVIDIA's accepts.
    """

    def __init__(self, max_active_world_size: int | None = None) -> None:
        if max_active_world_size is not None and max_active_world_size < 1:
            raise ValueError(
                f"max_active_world_size must be >= 1 or None, got {max_active_world_size!r}"
            )
        self.max_active_world_size = max_active_world_size

    def __call__(self, state: State) -> State:
        active = state.world_size
        if self.max_active_world_size is not None:
            active = min(active, self.max_active_world_size)
        return _keep_active(state, active)

    def __repr__(self) -> str:
        return f"MaxActiveWorldSize({self.max_active_world_size})"


class WorldSizeDivisibleBy:
    """Round the active world size down to a multiple of ``divisor``; the rest are spares.

    Useful when the model is split over groups of ``divisor`` ranks (tensor or
    pipeline parallel) and a partial group cannot train.
    """

    def __init__(self, divisor: int = 1) -> None:
        if divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {divisor!r}")
        self.divisor = divisor

    def __call__(self, state: State) -> State:
        return _keep_active(state, state.world_size // self.divisor * self.divisor)

    def __repr__(self) -> str:
        return f"WorldSizeDivisibleBy({self.divisor})"


class KeyStore(Protocol):
    """The part of a torch ``Store`` ``FilterCountGroupedByKey`` uses."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


# Every surviving rank runs the same filters in the same order, so the n-th call in one
# process meets the n-th call in the others under the same store keys.
_filter_calls = itertools.count()
_KEY_PREFIX = "stalwart/filter_count"
_MAX_KEY_BYTES = 4096


class FilterCountGroupedByKey:
    """NVIDIA 0.4's filter: ranks with equal keys form a group; every surviving rank of a
    group whose count of surviving ranks fails ``condition`` is added to the terminated
    ranks (the state itself is left as it is; an assignment after it renumbers).

    ``key_or_fn`` is a JSON-serialisable key or a function of the ``State`` giving one;
    the surviving ranks exchange their keys through ``ctx.store``, waiting at most
    ``timeout`` for each other.
    """

    def __init__(
        self,
        key_or_fn: Any,
        condition: Callable[[int], bool],
        timeout: timedelta = timedelta(minutes=5),
    ) -> None:
        if not callable(condition):
            raise ValueError(f"condition must be a function of a count, got {condition!r}")
        self.key_or_fn = key_or_fn
        self.condition = condition
        self.timeout = timeout

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state, store = ctx.state, ctx.store
        if not all(callable(getattr(store, m, None)) for m in ("set", "get", "wait")):
            raise TypeError(
                f"FilterCountGroupedByKey needs a torch Store in ctx.store, got {store!r}"
            )
        key = self.key_or_fn(state) if callable(self.key_or_fn) else self.key_or_fn
        try:
            mine = json.dumps(key, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"group key {key!r} of rank {state.rank} is not JSON: {exc}") from None
        prefix = f"{_KEY_PREFIX}/{next(_filter_calls)}/{state.world_size}"
        alive = [r for r in range(state.world_size) if r not in ctx.terminated_ranks]
        keystore: KeyStore = store  # type: ignore[assignment]
        keystore.set(f"{prefix}/{state.rank}", mine)
        keystore.wait([f"{prefix}/{r}" for r in alive], self.timeout)
        groups = {r: _group_key(r, keystore.get(f"{prefix}/{r}")) for r in alive}
        counts = Counter(groups.values())
        dropped = {r for r in alive if not self.condition(counts[groups[r]])}
        return RankAssignmentCtx(state, store, set(ctx.terminated_ranks) | dropped)

    def __repr__(self) -> str:
        return f"FilterCountGroupedByKey({self.key_or_fn!r}, {self.condition!r})"


def _group_key(rank: int, raw: bytes) -> str:
    """A peer's key as published (its JSON text identifies the group); anything else in
    its place is refused by name."""
    if len(raw) > _MAX_KEY_BYTES:
        raise RestartError(f"rank {rank}'s group key is {len(raw)} bytes, over {_MAX_KEY_BYTES}")
    try:
        return json.dumps(json.loads(raw), sort_keys=True)
    except (UnicodeDecodeError, ValueError):
        raise RestartError(f"rank {rank}'s group key {raw[:80]!r} is not JSON") from None
