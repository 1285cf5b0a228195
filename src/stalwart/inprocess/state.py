"""Plain data describing a rank: its identity across restarts and per-iteration role.

``State`` is what hooks, rank assignment and the rank filter receive; records
(``InterruptionRecord``) are what ranks publish to each other through the store,
always as JSON.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any


class Mode(enum.Enum):
    """Role of a rank in one iteration."""

    ACTIVE = "active"  # calls the wrapped function
    INACTIVE = "inactive"  # spare: waits, pinging, until needed or until completion
    TERMINATED = "terminated"  # has left the job


class Interruption(enum.Enum):
    """Why an iteration was interrupted."""

    EXCEPTION = "exception"
    SOFT_TIMEOUT = "soft_timeout"
    MISSING = "missing"  # heartbeat stopped: the rank vanished or froze
    HOOK = "hook"
    BASE_EXCEPTION = "base_exception"


@dataclasses.dataclass(frozen=True)
class InterruptionRecord:
    """Which rank (by initial rank) interrupted which iteration, and why."""

    rank: int
    iteration: int
    kind: Interruption
    message: str = ""

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "rank": self.rank,
                "iteration": self.iteration,
                "kind": self.kind.value,
                "message": self.message[:2000],
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> InterruptionRecord:
        data: dict[str, Any] = json.loads(raw)
        return cls(
            rank=int(data["rank"]),
            iteration=int(data["iteration"]),
            kind=Interruption(data["kind"]),
            message=str(data.get("message", "")),
        )


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


@dataclasses.dataclass
class State:
    """A rank's identity and role.

    ``initial_rank`` never changes and names the rank in every store record;
    ``rank``/``world_size`` are the numbers the wrapped function sees in the
    current iteration (only active ranks count in ``world_size``).
    """

    # ``State()`` alone is this process's identity from ``RANK``/``WORLD_SIZE`` (0 and 1
    # when unset), as NVIDIA's ``State()`` is: code written for it builds one that way.
    rank: int = dataclasses.field(default_factory=lambda: _env_int("RANK", 0))
    world_size: int = dataclasses.field(default_factory=lambda: _env_int("WORLD_SIZE", 1))
    initial_rank: int = -1  # -1: the rank given
    initial_world_size: int = -1  # -1: the world size given
    iteration: int = 0
    mode: Mode = Mode.ACTIVE
    active_world_size: int = 0
    terminated: frozenset[int] = frozenset()
    # The number the function sees when an assignment (``rank_tree.Tree``) keeps its own
    # numbering over every live rank in ``rank``: None unless one did (NVIDIA 0.4's field).
    active_rank: int | None = None
    # Socket fds the wrapper itself owns during this iteration (store clients,
    # monitor pipes); abort must leave them alone.
    protected_fds: frozenset[int] = frozenset()
    protected_ports: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.initial_rank < 0:
            self.initial_rank = self.rank
        if self.initial_world_size < 0:
            self.initial_world_size = self.world_size

    @property
    def alive_ranks(self) -> list[int]:
        """Initial ranks still in the job, in order."""
        return [r for r in range(self.initial_world_size) if r not in self.terminated]

    def freeze(self) -> FrozenState:
        """A read-only copy (NVIDIA 0.4's ``State.freeze()``)."""
        return FrozenState(**{f.name: getattr(self, f.name) for f in dataclasses.fields(State)})


class FrozenState(State):
    """A ``State`` whose fields cannot be assigned: what ``finalize`` and
    ``health_check`` hooks receive, as NVIDIA 0.4's do, since the wrapper ignores what
    they return and a change made in place would reach the wrapper's own record of the
    rank.  ``dataclasses.replace`` on one gives another."""

    _sealed = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if self._sealed:
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to field {name!r}: this State is read-only (a copy)"
            )
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(
            f"cannot delete field {name!r}: this State is read-only (a copy)"
        )
