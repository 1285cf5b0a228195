"""``initialize`` hooks in NVIDIA ``inprocess``'s shape: ``initialize(state) -> state``.

Runs at the start of every iteration, before the health check and the function.
A ``RestartError`` raised here ends the wrapper on this rank (it is re-raised
to the caller, not taken for a fault), which is how ``RetryController`` stops a
job that should not restart any more (its ``RestartLimitReached`` is also NVIDIA's
``RestartAbort``); any other exception is a fault like one from the function.
"""

from __future__ import annotations

from typing import Protocol

from .errors import RestartLimitReached
from .state import State


class Initialize(Protocol):
    def __call__(self, state: State) -> State: ...


class RetryController:
    """Stop restarting after ``max_iterations`` or below a minimum (active) world size.

    Every rank evaluates the same numbers, so all of them stop together.
    """

    def __init__(
        self,
        max_iterations: int | None = None,
        min_world_size: int = 1,
        min_active_world_size: int = 1,
    ) -> None:
        self.max_iterations = max_iterations
        self.min_world_size = min_world_size
        self.min_active_world_size = min_active_world_size

    def __call__(self, state: State) -> State:
        active = state.active_world_size or state.world_size
        if self.max_iterations is not None and state.iteration >= self.max_iterations:
            raise RestartLimitReached(
                f"iteration={state.iteration} reached max_iterations={self.max_iterations}"
            )
        if state.world_size < self.min_world_size:
            raise RestartLimitReached(
                f"world size {state.world_size} is below min_world_size={self.min_world_size}"
            )
        if active < self.min_active_world_size:
            raise RestartLimitReached(
                f"active world size {active} is below "
                f"min_active_world_size={self.min_active_world_size}"
            )
        return state
