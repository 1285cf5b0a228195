"""The per-iteration monitor thread: turns a fault anywhere into a restart here.

It polls the iteration's fault flag in the store (a few ms per poll), and every
``interval`` checks this rank's soft timeout and the peers' heartbeats.  When
the iteration must restart it waits for any ``atomic()`` block to finish, runs
``abort`` (which frees a main thread blocked in a collective), and injects
``RankShouldRestart`` into the main thread if that thread is still in user code a
moment later.  While it runs, it also hands every process group it sees to the
``GroupKeeper`` (``on_poll``).  It fires at most once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .asyncexc import async_raise, raise_in_thread, reraise_if_unraisable, wake
from .errors import RankShouldRestart
from .progress import ProgressClock
from .state import Interruption, InterruptionRecord, State
from .store import CoordStore

log = logging.getLogger(__name__)

# NVIDIA's names under its module path (``inprocess.monitor_thread.async_raise``).
__all__ = [
    "AtomicGate",
    "MonitorThread",
    "RankShouldRestart",
    "async_raise",
    "reraise_if_unraisable",
]

_FLAG_POLL = 0.005
_RELEASE_GRACE = 0.1


class AtomicGate:
    """Lets the main thread hold off a restart during an ``atomic()`` block.

    Deliberately lock-free: an async exception can land in the main thread
    between a lock's acquire and its release (even inside ``Condition.__exit__``)
    and leave the lock held forever.  Only the main thread writes ``depth`` and
    only the monitor writes ``pending``; the GIL orders the two, and each side
    checks the other's flag after writing its own, so a block is either entered
    before the restart starts (the restart waits for it) or not at all.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        # True while the main thread runs the monitored part of an iteration
        # (initialize, the function, the completion barrier).
        self.busy = False

    def enter(self) -> None:
        self.depth += 1
        if self.pending and self.depth == 1:
            # A restart is on its way: do not start the block, wait to be interrupted.
            self.depth -= 1
            deadline = time.monotonic() + 60.0
            while self.pending and time.monotonic() < deadline:
                time.sleep(0.001)
            self.depth += 1

    def exit(self) -> None:
        self.depth -= 1


class MonitorThread(threading.Thread):
    def __init__(
        self,
        *,
        state: State,
        store: CoordStore,
        participants: list[int],
        clock: ProgressClock,
        gate: AtomicGate,
        abort: Callable[[State], State | None] | None,
        interval: float,
        soft_timeout: float,
        main_thread_id: int,
        on_poll: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name=f"stalwart-inprocess-monitor-{state.iteration}", daemon=True)
        self.state = state
        self.store = store
        self.peers = [r for r in participants if r != state.initial_rank]
        self.clock = clock
        self.gate = gate
        self.abort = abort
        self.interval = interval
        self.soft_timeout = soft_timeout
        self.main_thread_id = main_thread_id
        self.on_poll = on_poll
        self.fired = False
        self.reason: InterruptionRecord | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            self._watch()
        except Exception:
            if not self._stop_event.is_set():
                log.exception("monitor thread failed on rank %d", self.state.rank)

    def _watch(self) -> None:
        it = self.state.iteration
        next_check = time.monotonic() + self.interval
        while not self._stop_event.wait(_FLAG_POLL):
            if self.on_poll is not None:
                self.on_poll()
            record = self.store.fault(it)
            if record is None and time.monotonic() >= next_check:
                next_check = time.monotonic() + self.interval
                record = self._local_checks()
                if record is not None:
                    self.store.record_interruption(record)
            if record is not None:
                self._fire(record)
                return

    def _local_checks(self) -> InterruptionRecord | None:
        it = self.state.iteration
        # As NVIDIA's: the manual timestamp once the function pings, else the automatic
        # one, which only the main thread running Python moves (see progress.py).
        age = self.clock.manual_age()
        what = "no ping"
        if age is None:
            age = self.clock.auto_age()
            what = "main thread ran no Python"
        if age > self.soft_timeout:
            log.warning(
                "rank %d: no progress (%s) for %.2fs (soft timeout %.2fs), restarting",
                self.state.rank,
                what,
                age,
                self.soft_timeout,
            )
            return InterruptionRecord(
                self.state.initial_rank, it, Interruption.SOFT_TIMEOUT, f"{what} for {age:.2f}s"
            )
        for peer in self.peers:
            if self.store.is_gone(peer):
                self.store.record_terminated(peer, "heartbeat lost")
                return InterruptionRecord(peer, it, Interruption.MISSING, "heartbeat lost")
        return None

    def _fire(self, record: InterruptionRecord) -> None:
        self.gate.pending = True
        while self.gate.depth > 0 and not self._stop_event.is_set():
            time.sleep(0.001)
        if self._stop_event.is_set():
            self.gate.pending = False
            return
        self.fired = True
        self.reason = record
        log.info(
            "rank %d iteration %d: restart (initial rank %d: %s %s)",
            self.state.rank,
            self.state.iteration,
            record.rank,
            record.kind.value,
            record.message[:200],
        )
        # From here on the restart is the wrapper's work, not user progress:
        # the hard timeout falls back to the automatic tick.
        self.clock.disarm()
        if self.abort is not None:
            try:
                aborted = self.abort(self.state)
                if isinstance(aborted, State):
                    self.state = aborted
            except Exception:
                log.exception("abort failed on rank %d", self.state.rank)
        # A main thread blocked in a collective returns by itself once abort
        # closed its connections, with an ordinary exception.  Injecting the
        # restart there instead can land it inside torch's C++ -> Python
        # callbacks (autograd, DDP hooks); measured: the failed iteration's DDP
        # objects then deadlock, GIL held, when they are freed.  So give it a
        # moment, and inject only into a thread still busy in user code.
        deadline = time.monotonic() + _RELEASE_GRACE
        while self.gate.busy and time.monotonic() < deadline:
            time.sleep(0.001)
        if self.gate.busy:
            raise_in_thread(self.main_thread_id, RankShouldRestart)
            wake(self.main_thread_id)

    def request_stop(self) -> None:
        """Ask the thread to end without firing; returns at once."""
        self._stop_event.set()

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.get_ident() != self.ident:
            self.join()
