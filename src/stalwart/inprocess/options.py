"""Wrapper options: one dataclass, with type and ordering validation.

Each option is declared here once: ``Wrapper`` takes exactly these keywords (it
is this dataclass plus ``__call__``).  Durations are seconds (float) or
``datetime.timedelta``; they are stored as float seconds.  Every violated rule
is reported as a ``ConfigError`` naming the options involved.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable
from typing import Any, Literal, overload

from torch._C._distributed_c10d import Store

from .abort import AbortTorchDistributed
from .assignment import RankAssignment, RankFilter, ShiftRanks
from .errors import ConfigError
from .hooks import check_hook
from .state import State
from .store import tcp_store

Seconds = float | int | datetime.timedelta
# NVIDIA inprocess's hook shapes (see hooks.py); ``None`` from a state-returning
# hook means "unchanged".
Initialize = Callable[[State], State | None]
AbortHook = Callable[[State], State | None]
Finalize = Callable[[State, BaseException | None], object]
HealthCheck = Callable[[State, BaseException | None], object]

RANK_NUMBERINGS = ("current", "initial")

# (smaller, larger): the first must be strictly below the second.
_ORDER = (
    ("soft_timeout", "hard_timeout"),
    ("hard_timeout", "barrier_timeout"),
    ("heartbeat_timeout", "barrier_timeout"),
    ("monitor_thread_interval", "soft_timeout"),
    ("monitor_thread_interval", "heartbeat_timeout"),
    ("progress_watchdog_interval", "soft_timeout"),
    ("progress_watchdog_interval", "heartbeat_timeout"),
    ("monitor_process_interval", "hard_timeout"),
    ("monitor_process_interval", "heartbeat_timeout"),
    ("monitor_process_interval", "barrier_timeout"),
)


def to_seconds(name: str, value: Any) -> float:
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be seconds (float) or timedelta, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    return float(value)


class Duration:
    """A duration option: seconds or ``timedelta`` in (checked at once), float seconds out.

    A descriptor, so that the dataclass's ``__init__`` accepts both forms while every
    reader sees a float, with the option declared once."""

    def __init__(self, default: float) -> None:
        self.default = default
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> float: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> float: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> float:
        if obj is None:  # the dataclass asks the class for the field's default
            return self.default
        value: float = obj.__dict__[self.name]
        return value

    def __set__(self, obj: object, value: Seconds) -> None:
        obj.__dict__[self.name] = to_seconds(self.name, value)


@dataclasses.dataclass(eq=False, kw_only=True)
class Options:
    store_factory: Callable[..., Store] = tcp_store
    store_kwargs: dict[str, Any] | None = None
    initialize: Initialize | None = None
    abort: AbortHook | None = dataclasses.field(default_factory=AbortTorchDistributed)
    finalize: Finalize | None = None
    health_check: HealthCheck | None = None
    # None (which NVIDIA's Wrapper also accepts) means ShiftRanks().
    rank_assignment: RankAssignment = dataclasses.field(default_factory=ShiftRanks)
    rank_filter: RankFilter | None = None
    # What ``rank_assignment`` is given (docs/migrating.md): "current", NVIDIA's contract
    # (the numbers the last assignment gave and the ranks terminated since, in that
    # numbering); "initial", every rank's initial numbers and every rank gone so far.
    rank_numbering: Literal["current", "initial"] = "current"
    monitor_thread_interval: Duration = Duration(0.5)
    monitor_process_interval: Duration = Duration(0.5)
    progress_watchdog_interval: Duration = Duration(0.5)
    soft_timeout: Duration = Duration(60.0)
    hard_timeout: Duration = Duration(90.0)
    heartbeat_timeout: Duration = Duration(10.0)
    barrier_timeout: Duration = Duration(120.0)
    completion_timeout: Duration = Duration(120.0)
    last_call_wait: Duration = Duration(1.0)
    termination_grace_time: Duration = Duration(5.0)
    monitor_process_logfile: str | None = None
    max_iterations: int | None = None
    enabled: bool = True

    def __post_init__(self) -> None:
        if not callable(self.store_factory):
            raise ConfigError(f"store_factory must be callable, got {self.store_factory!r}")
        if self.store_kwargs is not None and not isinstance(self.store_kwargs, dict):
            raise ConfigError(f"store_kwargs must be a dict or None, got {self.store_kwargs!r}")
        if self.rank_assignment is None:
            self.rank_assignment = ShiftRanks()
        if self.rank_numbering not in RANK_NUMBERINGS:
            raise ConfigError(
                f"rank_numbering must be one of {', '.join(map(repr, RANK_NUMBERINGS))}, "
                f"got {self.rank_numbering!r}"
            )
        for name in (
            "initialize",
            "abort",
            "finalize",
            "health_check",
            "rank_assignment",
            "rank_filter",
        ):
            check_hook(name, getattr(self, name))
        for small, large in _ORDER:
            a, b = getattr(self, small), getattr(self, large)
            if not a < b:
                raise ConfigError(f"{small} ({a:g}s) must be less than {large} ({b:g}s)")
        log_file = self.monitor_process_logfile
        if log_file is not None and (not isinstance(log_file, str) or not os.path.isabs(log_file)):
            raise ConfigError(f"monitor_process_logfile must be an absolute path, got {log_file!r}")
        if self.max_iterations is not None and (
            isinstance(self.max_iterations, bool)
            or not isinstance(self.max_iterations, int)
            or self.max_iterations < 1
        ):
            raise ConfigError(f"max_iterations must be an int >= 1, got {self.max_iterations!r}")
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"enabled must be a bool, got {self.enabled!r}")
