"""torch elastic's timer API (``torch.distributed.elastic.timer.api``): `TimerRequest`,
`TimerClient`, `RequestQueue`, `TimerServer`, `configure`, `expires`.

The abstract shapes that torch's timer servers and clients share, so that code written
against them (a server of its own over a `RequestQueue`, a client passed to `expires`)
runs with only its import line changed. The concrete servers are `file_timer`'s
(over stalwart's pipe server) and `torch_local_timer`'s (over a multiprocessing queue).

What the watchdog round does, as in torch: read up to the queue's size of requests
(waiting at most `max_interval`), register them, reap every worker with an expired
timer, and clear the timers of the workers reaped (a `_reap_worker` that raises counts
as reaped, one that returns False is retried next round). Stalwart's round reads at
most `MAX_REQUESTS_PER_ROUND`, so a flood of requests cannot hold back the reaping.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import math
import sys
import threading
import time
from collections.abc import Hashable, Iterator

log = logging.getLogger(__name__)

__all__ = [
    "MAX_REQUESTS_PER_ROUND",
    "RequestQueue",
    "TimerClient",
    "TimerRequest",
    "TimerServer",
    "configure",
    "expires",
]

#: Requests one watchdog round reads before it reaps.
MAX_REQUESTS_PER_ROUND = 4096


@dataclasses.dataclass(slots=True)
class TimerRequest:
    """An acquire (`expiration_time` >= 0, wall clock) or a release (< 0) of the timer
    `scope_id` of one worker; what identifies the worker is the server's choice (a pid
    for the local and file servers)."""

    worker_id: Hashable
    scope_id: str
    expiration_time: float


class TimerClient(abc.ABC):
    """The worker's side: arms and disarms its timers on a server."""

    @abc.abstractmethod
    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Arms (or re-arms) the timer `scope_id` of this worker."""

    @abc.abstractmethod
    def release(self, scope_id: str) -> None:
        """Disarms the timer `scope_id` of this worker (nothing if it is not armed)."""


class RequestQueue(abc.ABC):
    """Where a server reads its clients' requests."""

    @abc.abstractmethod
    def size(self) -> int:
        """How many requests are waiting now (it only grows until `get` is called)."""

    @abc.abstractmethod
    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        """Up to `size` requests, waiting at most `timeout` seconds for them."""


class TimerServer(abc.ABC):
    """Reaps the workers whose timers expire, from a watchdog thread (`start`/`stop`)
    or one round at a time (`_run_watchdog`)."""

    def __init__(
        self, request_queue: RequestQueue, max_interval: float, daemon: bool = True
    ) -> None:
        if not max_interval > 0 or math.isinf(max_interval):
            raise ValueError(
                f"max_interval must be a finite number of seconds > 0, got {max_interval!r}"
            )
        self._request_queue = request_queue
        self._max_interval = max_interval
        self._daemon = daemon
        self._stopping = threading.Event()
        self._watchdog_thread: threading.Thread | None = None

    @abc.abstractmethod
    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        """Applies acquires and releases (a negative expiration time) to the table."""

    @abc.abstractmethod
    def clear_timers(self, worker_ids: set[Hashable]) -> None:
        """Drops every timer of these workers."""

    @abc.abstractmethod
    def get_expired_timers(self, deadline: float) -> dict[Hashable, list[TimerRequest]]:
        """The timers that expire at or before `deadline`, by worker."""

    @abc.abstractmethod
    def _reap_worker(self, worker_id: Hashable) -> bool:
        """Ends the worker: True once it is gone (or will never be), False to retry."""

    def _reap_worker_no_throw(self, worker_id: Hashable) -> bool:
        try:
            return self._reap_worker(worker_id)
        except Exception:
            # Counted as reaped: a worker whose reaping always raises would otherwise be
            # retried every round, for ever.
            log.exception("reaping worker %r raised; its timers are dropped", worker_id)
            return True

    def _run_watchdog(self) -> None:
        batch = min(max(1, self._request_queue.size()), MAX_REQUESTS_PER_ROUND)
        self.register_timers(self._request_queue.get(batch, self._max_interval))
        reaped: set[Hashable] = set()
        for worker_id, expired in self.get_expired_timers(time.time()).items():
            log.info(
                "timers %s of worker %r expired; reaping it",
                [r.scope_id for r in expired],
                worker_id,
            )
            if self._reap_worker_no_throw(worker_id):
                reaped.add(worker_id)
            else:
                log.error("could not reap worker %r; trying again next round", worker_id)
        self.clear_timers(reaped)

    def _watchdog_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self._run_watchdog()
            except Exception:  # the watchdog must outlive any one bad round
                log.exception("timer watchdog round failed")
                self._stopping.wait(self._max_interval)

    def start(self) -> None:
        """Starts the watchdog thread (a second call while it runs does nothing)."""
        if self._watchdog_thread is not None and self._watchdog_thread.is_alive():
            return
        self._stopping.clear()
        self._watchdog_thread = threading.Thread(
            target=self._watchdog_loop, name=type(self).__name__, daemon=self._daemon
        )
        self._watchdog_thread.start()
        log.info("%s started (max_interval=%s s)", type(self).__name__, self._max_interval)

    def stop(self) -> None:
        """Ends the watchdog after its round (waiting for it at most `max_interval`)."""
        self._stopping.set()
        if self._watchdog_thread is not None:
            self._watchdog_thread.join(self._max_interval)
            self._watchdog_thread = None


_client: TimerClient | None = None


def configure(timer_client: TimerClient | None) -> None:
    """Sets the client `expires` uses when it is given none (None: no default)."""
    global _client
    _client = timer_client


@contextlib.contextmanager
def expires(
    after: float, scope: str | None = None, client: TimerClient | None = None
) -> Iterator[None]:
    """The worker is reaped if the block is still running `after` seconds from now.

    Without `scope`, the caller's file:line names the timer, so a recursive call
    re-arms the one timer rather than stacking new ones.
    """
    if not after > 0 or after == float("inf"):
        raise ValueError(
            f"expires(after=...) must be a finite number of seconds > 0, got {after!r}"
        )
    if client is None:
        client = _client
    if client is None:
        raise RuntimeError("configure a timer client (timer.configure) before expires()")
    if scope is None:
        # Two frames up: contextmanager's __enter__, then the `with` statement.
        frame = sys._getframe(2)
        scope = f"{frame.f_code.co_filename}#{frame.f_lineno}"
    client.acquire(scope, time.time() + after)
    try:
        yield
    finally:
        client.release(scope)
