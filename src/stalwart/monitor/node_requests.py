"""What workers ask of the monitor through the timer pipe: expired timers, control requests.

Both are untrusted: only a worker of this attempt (or a process descending from one) is
ever signalled for an expired timer or has its request queued for the supervisor; any
other pid is refused and logged once. A request from a live pid that is not yet a
registered worker waits, bounded by CONTROL_GRACE, for its attempt to begin.
"""

from __future__ import annotations

import logging
import time

from stalwart.base import procs
from stalwart.base.events import Event
from stalwart.monitor import layout
from stalwart.monitor.judge import Verdict
from stalwart.monitor.node_hangs import NodeHangs
from stalwart.monitor.node_state import MAX_REFUSED_LOGGED
from stalwart.monitor.reports import ControlRequest, HangKind
from stalwart.monitor.timer_server import ExpiredTimer
from stalwart.monitor.wire import ControlMessage

log = logging.getLogger(__name__)

#: Control requests held while their sender is not (yet) a registered worker.
MAX_PENDING_CONTROLS = 64
#: Seconds a control request from a live, not yet registered pid waits for its attempt.
CONTROL_GRACE = 5.0


class NodeRequests(NodeHangs):
    """Timer and control-request handling of a node monitor."""

    def _on_timer_expired(self, timer: ExpiredTimer) -> None:
        rank = self._rank_of_pid(timer.pid)
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
        snap = layout.read_slot(self._mm, rank.local_rank) if self._mm is not None else None
        hb_age = None
        iteration = None
        if snap is not None and snap.pid == timer.pid:
            now = time.monotonic()
            hb_age = now - snap.last_hb if snap.last_hb > 0 else None
            iteration = snap.iteration if snap.iteration >= 0 else None
        verdict = Verdict(
            HangKind.TIMER, timer.scope_id, timer.timeout_hint or 0.0, hb_age, iteration
        )
        self._begin_hang(rank, timer.pid, verdict, timer.signal)
        self._wake.set()

    def _note_foreign(self, pid: int) -> bool:
        """True the first time `pid` is refused (so each is logged once, in bounded memory)."""
        with self._lock:
            if pid in self._refused_pids:
                return False
            if len(self._refused_pids) >= MAX_REFUSED_LOGGED:
                self._refused_pids.clear()
            self._refused_pids.add(pid)
            return True

    def _on_control(self, msg: ControlMessage) -> None:
        # Resolved now while the sender surely runs; one that arrives before its attempt
        # is registered waits (bounded) for begin_attempt or the supervisor's next poll.
        if self._accept_control(msg, time.monotonic()):
            return
        with self._lock:
            if len(self._pending_controls) >= MAX_PENDING_CONTROLS:
                self._pending_controls.pop(0)
            self._pending_controls.append((msg, time.monotonic()))

    def _resolve_controls(self) -> None:
        with self._lock:
            pending, self._pending_controls = self._pending_controls, []
        keep = [(msg, t) for msg, t in pending if not self._accept_control(msg, t)]
        with self._lock:
            self._pending_controls[:0] = keep

    def _accept_control(self, msg: ControlMessage, received: float) -> bool:
        """Queues the request of a worker; False while a live unknown sender may still turn
        out to be one (within CONTROL_GRACE); refuses (and logs once) anything else."""
        rank = self._rank_of_pid(msg.pid)
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
