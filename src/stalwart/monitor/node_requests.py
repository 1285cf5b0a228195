"""What workers ask of the monitor through the timer pipe: expired timers, control requests.

`RequestDesk` owns the requests: those queued for the supervisor, those waiting for
their sender's attempt, the pids refused. Both kinds are untrusted: only a worker of
this attempt (or a process descending from one) is ever signalled for an expired timer
or has its request queued; any other pid is refused and logged once. A request from a
live pid that is not yet a registered worker waits, bounded by CONTROL_GRACE, for its
attempt to begin.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from stalwart.base import procs
from stalwart.base.events import Event
from stalwart.monitor.judge import Verdict
from stalwart.monitor.node_slots import Slots
from stalwart.monitor.node_state import MAX_REFUSED_LOGGED, AttemptRanks, LogEvent, Rank
from stalwart.monitor.reports import ControlRequest, HangKind
from stalwart.monitor.timer_server import ExpiredTimer
from stalwart.monitor.wire import ControlMessage

log = logging.getLogger(__name__)

#: Control requests held while their sender is not (yet) a registered worker.
MAX_PENDING_CONTROLS = 64
#: Seconds a control request from a live, not yet registered pid waits for its attempt.
CONTROL_GRACE = 5.0

#: Handles a hang: the rank, the process to signal, the verdict, the signal asked for.
OnHung = Callable[[Rank, int, Verdict, int], None]


class RequestDesk:
    """The timer server's two callbacks, and the requests queue the supervisor polls."""

    def __init__(self, ranks: AttemptRanks, slots: Slots, emit: LogEvent, on_hung: OnHung) -> None:
        self._ranks = ranks
        self._slots = slots
        self._emit = emit
        self._on_hung = on_hung
        self._lock = threading.Lock()
        self._requests: list[ControlRequest] = []
        self._pending_controls: list[tuple[ControlMessage, float]] = []
        self._refused_pids: set[int] = set()

    def new_attempt(self) -> None:
        with self._lock:
            self._refused_pids.clear()

    def add(self, request: ControlRequest) -> None:
        """Queues a request the monitor makes itself (a straggler's node leaving)."""
        with self._lock:
            self._requests.append(request)

    def poll(self) -> list[ControlRequest]:
        self.resolve()
        with self._lock:
            out, self._requests = self._requests, []
        return out

    def on_timer_expired(self, timer: ExpiredTimer) -> None:
        rank = self._ranks.owner_of(timer.pid)
        if rank is None:
            # Only workers of this attempt (and their children) are ever signalled on
            # request: a timer must not become a way to kill the guardian, the warm
            # template, the launcher's parent or anyone else.
            if self._note_foreign(timer.pid):
                log.warning(
                    "timer %r expired for pid %d, which is no worker of this attempt; not signalled",
                    timer.scope_id,
                    timer.pid,
                )
                self._emit(
                    Event.TIMER_EXPIRED,
                    {"pid": timer.pid, "scope": timer.scope_id, "rank": None, "reaped": False},
                )
            return
        snap = self._slots.read(rank.local_rank)
        hb_age = None
        iteration = None
        if snap is not None and snap.pid == timer.pid:
            now = time.monotonic()
            hb_age = now - snap.last_hb if snap.last_hb > 0 else None
            iteration = snap.iteration if snap.iteration >= 0 else None
        verdict = Verdict(
            HangKind.TIMER, timer.scope_id, timer.timeout_hint or 0.0, hb_age, iteration
        )
        self._on_hung(rank, timer.pid, verdict, timer.signal)

    def _note_foreign(self, pid: int) -> bool:
        """True the first time `pid` is refused (so each is logged once, in bounded memory)."""
        with self._lock:
            if pid in self._refused_pids:
                return False
            if len(self._refused_pids) >= MAX_REFUSED_LOGGED:
                self._refused_pids.clear()
            self._refused_pids.add(pid)
            return True

    def on_control(self, msg: ControlMessage) -> None:
        # Resolved now while the sender surely runs; one that arrives before its attempt
        # is registered waits (bounded) for begin_attempt or the supervisor's next poll.
        if self._accept_control(msg, time.monotonic()):
            return
        with self._lock:
            if len(self._pending_controls) >= MAX_PENDING_CONTROLS:
                self._pending_controls.pop(0)
            self._pending_controls.append((msg, time.monotonic()))

    def resolve(self) -> None:
        with self._lock:
            pending, self._pending_controls = self._pending_controls, []
        keep = [(msg, t) for msg, t in pending if not self._accept_control(msg, t)]
        with self._lock:
            self._pending_controls[:0] = keep

    def _accept_control(self, msg: ControlMessage, received: float) -> bool:
        """Queues the request of a worker; False while a live unknown sender may still turn
        out to be one (within CONTROL_GRACE); refuses (and logs once) anything else."""
        rank = self._ranks.owner_of(msg.pid)
        if rank is None:
            if time.monotonic() - received < CONTROL_GRACE and procs.is_alive(msg.pid):
                return False
            if self._note_foreign(msg.pid):
                log.warning(
                    "control request %s from pid %d, which is no worker of this attempt; ignored",
                    msg.action.value,
                    msg.pid,
                )
                self._emit(
                    Event.CONTROL_REQUEST_REFUSED, {"pid": msg.pid, "action": msg.action.value}
                )
            return True
        req = ControlRequest(
            action=msg.action,
            # The registered rank, not the one the message claims.
            global_rank=rank.global_rank,
            local_rank=rank.local_rank,
            pid=msg.pid,
            received_at=time.time(),
        )
        with self._lock:
            self._requests.append(req)
        # The supervisor records the request (and its decision) in events.jsonl.
        log.info("rank %s (pid %d) requests %s", req.global_rank, req.pid, req.action.value)
        return True
