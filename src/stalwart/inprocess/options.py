"""Wrapper options: one dataclass, with type and ordering validation.

Durations are seconds (float) or ``datetime.timedelta``; they are stored as
float seconds.  Every violated rule is reported as a ``ConfigError`` naming the
options involved.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable
from typing import Any

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

_DURATIONS = (
    "monitor_thread_interval",
    "monitor_process_interval",
    "progress_watchdog_interval",
    "soft_timeout",
    "hard_timeout",
    "heartbeat_timeout",
    "barrier_timeout",
    "completion_timeout",
    "last_call_wait",
    "termination_grace_time",
)

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


@dataclasses.dataclass
class Options:
    store_factory: Callable[..., Store] = tcp_store
    store_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    initialize: Initialize | None = None
    abort: AbortHook | None = dataclasses.field(default_factory=AbortTorchDistributed)
    finalize: Finalize | None = None
    health_check: HealthCheck | None = None
    rank_assignment: RankAssignment = dataclasses.field(default_factory=ShiftRanks)
    rank_filter: RankFilter | None = None
    monitor_thread_interval: float = 0.5
    monitor_process_interval: float = 0.5
    progress_watchdog_interval: float = 0.5
    soft_timeout: float = 60.0
    hard_timeout: float = 90.0
    heartbeat_timeout: float = 10.0
    barrier_timeout: float = 120.0
    completion_timeout: float = 120.0
    last_call_wait: float = 1.0
    termination_grace_time: float = 5.0
    monitor_process_logfile: str | None = None
    max_iterations: int | None = None
    enabled: bool = True

    def __post_init__(self) -> None:
        for name in _DURATIONS:
            setattr(self, name, to_seconds(name, getattr(self, name)))
        if not callable(self.store_factory):
            raise ConfigError(f"store_factory must be callable, got {self.store_factory!r}")
        if self.store_kwargs is None:
            self.store_kwargs = {}
        if not isinstance(self.store_kwargs, dict):
            raise ConfigError(f"store_kwargs must be a dict or None, got {self.store_kwargs!r}")
        if self.rank_assignment is None:
            raise ConfigError("rank_assignment must be callable, got None")
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
