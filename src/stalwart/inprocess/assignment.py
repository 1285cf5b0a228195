"""Rank assignment (who gets which rank after ranks were terminated) and rank filters
(which ranks call the function, which wait as spares).

Both are pure functions of the ``State`` and the authoritative terminated set,
so every rank computes the same answer without talking to the others.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from .errors import RestartError
from .state import Mode, State


class RankAssignment(Protocol):
    """Returns the state for the next iteration given the terminated initial ranks."""

    def __call__(self, state: State, terminated: frozenset[int]) -> State: ...


class RankFilter(Protocol):
    """Marks a rank active or inactive for the next iteration."""

    def __call__(self, state: State) -> State: ...


class ShiftRanks:
    """Survivors keep their order and are renumbered 0..n-1; world size shrinks."""

    def __call__(self, state: State, terminated: frozenset[int]) -> State:
        alive = [r for r in range(state.initial_world_size) if r not in terminated]
        if not alive:
            raise RestartError("no ranks left")
        if state.initial_rank not in alive:
            return dataclasses.replace(state, mode=Mode.TERMINATED, terminated=terminated)
        return dataclasses.replace(
            state,
            rank=alive.index(state.initial_rank),
            world_size=len(alive),
            active_world_size=len(alive),
            mode=Mode.ACTIVE,
            terminated=terminated,
        )

    def __repr__(self) -> str:
        return "ShiftRanks()"


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
