"""torch elastic's multiprocessing-queue timers (``torch.distributed.elastic.timer.
local_timer``): `LocalTimerClient`, `MultiprocessingRequestQueue`, `LocalTimerServer`.

The server runs in the process that started the workers and reads their requests from
a ``multiprocessing`` queue they were handed; an expired timer ends its worker with
SIGKILL. The queue is an anonymous pipe: only processes that were given it can write
to it, so its pickles come from this user's own workers, never from another user.

What differs from torch, deliberately: the server signals only its own descendants,
never a pid <= 1, a process group (a negative pid) or itself, so a request naming any
other process, however it got into the queue, signals nothing (its timers are dropped
when they expire); what is not a well-formed request (another object, a scope longer
than `MAX_SCOPE_CHARS`, an expiration time that is not a finite number) is dropped; the
table holds at most `MAX_TIMERS_PER_PID` timers per worker and `MAX_TIMERS` in all.
A worker using torch's own client is served as well: its requests are read by their
fields, not their class.
"""

from __future__ import annotations

import logging
import math
import multiprocessing.queues
import os
import queue
import signal
import time
from collections.abc import Hashable
from typing import Any

from stalwart.base import procs
from stalwart.monitor.torch_timer import RequestQueue, TimerClient, TimerRequest, TimerServer

log = logging.getLogger(__name__)

__all__ = [
    "MAX_SCOPE_CHARS",
    "MAX_TIMERS",
    "MAX_TIMERS_PER_PID",
    "LocalTimerClient",
    "LocalTimerServer",
    "MultiprocessingRequestQueue",
    "parse_request",
    "refusal",
]

#: Longest scope name kept (a default scope is a file path and a line number).
MAX_SCOPE_CHARS = 4096
#: Timers one worker may hold at once; more are refused (a client leaking scope names).
MAX_TIMERS_PER_PID = 4096
#: Timers held at once, all workers together.
MAX_TIMERS = 16384

MpQueue = multiprocessing.queues.Queue  # what `multiprocessing.Queue()` returns


class LocalTimerClient(TimerClient):
    """Sends this process's timers to the `LocalTimerServer` reading `mp_queue`."""

    def __init__(self, mp_queue: MpQueue[Any]) -> None:
        self._mp_queue = mp_queue

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self._mp_queue.put(TimerRequest(os.getpid(), scope_id, expiration_time))

    def release(self, scope_id: str) -> None:
        self._mp_queue.put(TimerRequest(os.getpid(), scope_id, -1))


class MultiprocessingRequestQueue(RequestQueue):
    """A `RequestQueue` over a ``multiprocessing`` queue."""

    def __init__(self, mp_queue: MpQueue[Any]) -> None:
        self._mp_queue = mp_queue

    def size(self) -> int:
        return self._mp_queue.qsize()

    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        """Up to `size` items, waiting at most `timeout` seconds in all."""
        items: list[Any] = []
        deadline = time.monotonic() + max(0.0, timeout)
        while len(items) < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                items.append(self._mp_queue.get(block=True, timeout=remaining))
            except queue.Empty:
                break
        return items


def parse_request(item: object) -> TimerRequest | str:
    """The request `item` carries (ours or torch's: read by field), or why it is dropped."""
    worker_id = getattr(item, "worker_id", None)
    scope_id = getattr(item, "scope_id", None)
    expiration_time = getattr(item, "expiration_time", None)
    if type(worker_id) is not int:
        return f"worker_id must be a pid (an int), got {type(worker_id).__name__}"
    if not isinstance(scope_id, str):
        return f"scope_id must be a str, got {type(scope_id).__name__}"
    if len(scope_id) > MAX_SCOPE_CHARS:
        return f"scope_id of {len(scope_id)} characters (at most {MAX_SCOPE_CHARS})"
    if not isinstance(expiration_time, int | float) or type(expiration_time) is bool:
        return f"expiration_time must be a number, got {type(expiration_time).__name__}"
    if not math.isfinite(expiration_time):
        return f"expiration_time must be a finite number, got {expiration_time!r:.40}"
    return TimerRequest(worker_id, scope_id, float(expiration_time))


def refusal(pid: int, own_pid: int, descends: bool) -> str | None:
    """Why the server must not signal `pid` (None: it may)."""
    if pid <= 0:
        return f"pid {pid} would signal a process group"
    if pid == 1:
        return "pid 1 is init"
    if pid == own_pid:
        return "it is the timer server's own process"
    if not descends:
        return "it is not a process this server's process started"
    return None


class LocalTimerServer(TimerServer):
    """Reaps, with SIGKILL, the workers whose timers in `mp_queue` expire."""

    def __init__(self, mp_queue: MpQueue[Any], max_interval: float = 60, daemon: bool = True):
        super().__init__(MultiprocessingRequestQueue(mp_queue), max_interval, daemon)
        self._timers: dict[tuple[Hashable, str], TimerRequest] = {}
        self._per_worker: dict[Hashable, int] = {}
        self.dropped = 0  # items that were not requests, or were refused
        self._complaints = 0

    def _complain(self, what: str) -> None:
        self.dropped += 1
        self._complaints += 1
        # A worker stuck in a loop must not flood the log: the first ten, then 1 in 1000.
        if self._complaints <= 10 or self._complaints % 1000 == 0:
            log.warning("LocalTimerServer dropped a request (%d so far): %s", self.dropped, what)

    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        for item in timer_requests:
            request = parse_request(item)
            if isinstance(request, str):
                self._complain(request)
                continue
            key = (request.worker_id, request.scope_id)
            if request.expiration_time < 0:
                if self._timers.pop(key, None) is not None:
                    self._forget_one(request.worker_id)
                continue
            if key not in self._timers:
                held = self._per_worker.get(request.worker_id, 0)
                if held >= MAX_TIMERS_PER_PID or len(self._timers) >= MAX_TIMERS:
                    self._complain(f"timer table full for worker {request.worker_id}")
                    continue
                self._per_worker[request.worker_id] = held + 1
            self._timers[key] = request

    def _forget_one(self, worker_id: Hashable) -> None:
        left = self._per_worker.get(worker_id, 0) - 1
        if left > 0:
            self._per_worker[worker_id] = left
        else:
            self._per_worker.pop(worker_id, None)

    def clear_timers(self, worker_ids: set[Hashable]) -> None:
        if not worker_ids:
            return
        for key in [k for k in self._timers if k[0] in worker_ids]:
            del self._timers[key]
        for worker_id in worker_ids:
            self._per_worker.pop(worker_id, None)

    def get_expired_timers(self, deadline: float) -> dict[Hashable, list[TimerRequest]]:
        expired: dict[Hashable, list[TimerRequest]] = {}
        for request in self._timers.values():
            if request.expiration_time <= deadline:
                expired.setdefault(request.worker_id, []).append(request)
        return expired

    def _reap_worker(self, worker_id: Hashable) -> bool:
        if not isinstance(worker_id, int):  # never here: register_timers keeps pids only
            return True
        own = os.getpid()
        why = refusal(worker_id, own, worker_id > 1 and procs.is_descendant(worker_id, own))
        if why is not None:
            log.error("not reaping pid %d: %s; its timers are dropped", worker_id, why)
            return True
        try:
            os.kill(worker_id, signal.SIGKILL)
        except ProcessLookupError:
            log.info("pid %d ended before its timer expired", worker_id)
        except OSError as exc:
            log.error("cannot kill pid %d: %s; trying again next round", worker_id, exc)
            return False
        return True
