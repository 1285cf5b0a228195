"""Rank assignment (who gets which rank after ranks were terminated) and rank filters
(which ranks call the function, which wait as spares).

Both are pure functions of the ``State`` and the authoritative terminated set,
so every rank computes the same answer without talking to the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Set
from typing import Protocol

from .errors import RestartError
from .state import Mode, State


class RankAssignment(Protocol):
    """Places this rank for the next iteration given the terminated initial ranks.

    Returns ``(state, terminated)`` as NVIDIA's ``inprocess`` does: the second
    item is the terminated ranks this assignment did not account for, which
    must be empty (the wrapper raises ``RestartError`` otherwise); composed
    assignments pass it along.
    """

    def __call__(self, state: State, terminated: Set[int]) -> tuple[State, Set[int]]: ...


class RankFilter(Protocol):
    """Marks a rank active or inactive for the next iteration."""

    def __call__(self, state: State) -> State: ...


class ShiftRanks:
    """Survivors keep their order and are renumbered 0..n-1; world size shrinks."""

    def __call__(self, state: State, terminated: Set[int]) -> tuple[State, Set[int]]:
        gone = frozenset(terminated)
        alive = [r for r in range(state.initial_world_size) if r not in gone]
        if not alive:
            raise RestartError("no ranks left")
        if state.initial_rank not in alive:
            return dataclasses.replace(state, mode=Mode.TERMINATED, terminated=gone), set()
        placed = dataclasses.replace(
            state,
            rank=alive.index(state.initial_rank),
            world_size=len(alive),
            active_world_size=len(alive),
            mode=Mode.ACTIVE,
            terminated=gone,
        )
        return placed, set()

    def __repr__(self) -> str:
        return "ShiftRanks()"


class FillGaps:
    """Survivors keep their rank where they can; the highest ones move into the gaps.

    With ``n`` survivors, a survivor whose initial rank is below ``n`` keeps it,
    and the survivors at ``n`` or above take the terminated ranks below ``n``,
    the highest survivor the lowest gap.  Fewer ranks change number than with
    ``ShiftRanks`` (whose order-keeping renumbers everyone after a gap).
    """

    def __call__(self, state: State, terminated: Set[int]) -> tuple[State, Set[int]]:
        gone = frozenset(terminated)
        alive = [r for r in range(state.initial_world_size) if r not in gone]
        if not alive:
            raise RestartError("no ranks left")
        if state.initial_rank not in alive:
            return dataclasses.replace(state, mode=Mode.TERMINATED, terminated=gone), set()
        size = len(alive)
        gaps = [r for r in range(size) if r in gone]
        movers = sorted((r for r in alive if r >= size), reverse=True)
        new_rank = dict(zip(movers, gaps, strict=True))
        placed = dataclasses.replace(
            state,
            rank=new_rank.get(state.initial_rank, state.initial_rank),
            world_size=size,
            active_world_size=size,
            mode=Mode.ACTIVE,
            terminated=gone,
        )
        return placed, set()

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
