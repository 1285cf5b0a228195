"""``Wrapper``: the public decorator that restarts a distributed function in-process."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from torch._C._distributed_c10d import Store

from .abort import AbortTorchDistributed
from .assignment import RankAssignment, RankFilter, ShiftRanks
from .options import AbortHook, Finalize, HealthCheck, Initialize, Options, Seconds, to_seconds
from .runner import run_plain, run_wrapped
from .store import tcp_store

P = ParamSpec("P")
R = TypeVar("R")

_DEFAULT_ABORT = AbortTorchDistributed()


class Wrapper:
    """Decorator: on a fault on any rank, all healthy ranks re-enter the function together.

    Durations are seconds or ``timedelta``.  Hooks have NVIDIA ``inprocess``'s
    shapes (see ``hooks.py``).  See docs/inprocess.md for each option.
    The wrapped function returns its value on active ranks and ``None`` on spares.
    """

    def __init__(
        self,
        *,
        store_factory: Callable[..., Store] = tcp_store,
        store_kwargs: dict[str, Any] | None = None,
        initialize: Initialize | None = None,
        abort: AbortHook | None = _DEFAULT_ABORT,
        finalize: Finalize | None = None,
        health_check: HealthCheck | None = None,
        rank_assignment: RankAssignment | None = None,
        rank_filter: RankFilter | None = None,
        monitor_thread_interval: Seconds = 0.5,
        monitor_process_interval: Seconds = 0.5,
        progress_watchdog_interval: Seconds = 0.5,
        soft_timeout: Seconds = 60.0,
        hard_timeout: Seconds = 90.0,
        heartbeat_timeout: Seconds = 10.0,
        barrier_timeout: Seconds = 120.0,
        completion_timeout: Seconds = 120.0,
        last_call_wait: Seconds = 1.0,
        termination_grace_time: Seconds = 5.0,
        monitor_process_logfile: str | None = None,
        max_iterations: int | None = None,
        enabled: bool = True,
    ) -> None:
        self.options = Options(
            store_factory=store_factory,
            store_kwargs=store_kwargs if store_kwargs is not None else {},
            initialize=initialize,
            abort=abort,
            finalize=finalize,
            health_check=health_check,
            rank_assignment=rank_assignment if rank_assignment is not None else ShiftRanks(),
            rank_filter=rank_filter,
            monitor_thread_interval=to_seconds("monitor_thread_interval", monitor_thread_interval),
            monitor_process_interval=to_seconds(
                "monitor_process_interval", monitor_process_interval
            ),
            progress_watchdog_interval=to_seconds(
                "progress_watchdog_interval", progress_watchdog_interval
            ),
            soft_timeout=to_seconds("soft_timeout", soft_timeout),
            hard_timeout=to_seconds("hard_timeout", hard_timeout),
            heartbeat_timeout=to_seconds("heartbeat_timeout", heartbeat_timeout),
            barrier_timeout=to_seconds("barrier_timeout", barrier_timeout),
            completion_timeout=to_seconds("completion_timeout", completion_timeout),
            last_call_wait=to_seconds("last_call_wait", last_call_wait),
            termination_grace_time=to_seconds("termination_grace_time", termination_grace_time),
            monitor_process_logfile=monitor_process_logfile,
            max_iterations=max_iterations,
            enabled=enabled,
        )

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R | None]:
        options = self.options

        @functools.wraps(fn)
        def wrapped(*args: P.args, **kwargs: P.kwargs) -> R | None:
            if not options.enabled:
                result: R = run_plain(fn, args, dict(kwargs))
                return result
            value: R | None = run_wrapped(options, fn, args, dict(kwargs))
            return value

        return wrapped
