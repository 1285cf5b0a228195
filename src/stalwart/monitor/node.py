"""`NodeMonitor`: the launcher-side owner of one node's hang detection.

It creates the per-run folder (0700), the shared-memory segment and the timer pipe
(0600), and runs two threads: the timer server and a scanner that judges every armed
rank's slot each `check_interval`. A hung rank is asked for its stacks (a real-time
signal, with SIGCONT in case it is stopped), then sent the terminate signal, then SIGKILL after the
grace period; a `HangReport` is queued for the supervisor and a `hang_detected` event
logged. Never imports the launcher: the supervisor drives it through the methods below.

`NodeMonitor` is a thin coordinator: it holds the scanner loop and the supervisor's
calls, and owns one object per concern, each given only what it acts on:
`AttemptRanks` and `EventSink` (`node_state`), `Slots` (`node_slots`), `HangHandler`
(`node_hangs`), `RequestDesk` (`node_requests`, the timer pipe's callbacks), `Learning`
(`node_learned`, auto timeouts), `StragglerWatch` (`node_stragglers`), `JobSync`
(`node_sync`, the job's store), and `Suspicions` (evidence mode).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import mmap
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from stalwart.base import procs
from stalwart.base.events import Event
from stalwart.monitor import envvars, evidence, layout
from stalwart.monitor.config import MonitorConfig
from stalwart.monitor.evidence import Reading, Role
from stalwart.monitor.jobsync import JobPeers
from stalwart.monitor.judge import (
    BLAME_RESOLUTION,
    Stalled,
    Verdict,
    judge,
    judged_early,
    lookout,
    next_deadline,
    problems,
)
from stalwart.monitor.node_hangs import HangHandler
from stalwart.monitor.node_learned import Learning
from stalwart.monitor.node_requests import RequestDesk
from stalwart.monitor.node_slots import Slots
from stalwart.monitor.node_state import (
    LEARNED_NAME,
    PIPE_NAME,
    SHM_NAME,
    AttemptRanks,
    EventSink,
    LogEvent,
    Rank,
    ask_stacks,
    ensure_private_dir,
)
from stalwart.monitor.node_stragglers import StragglerWatch
from stalwart.monitor.node_sync import JobSync
from stalwart.monitor.reports import ControlRequest, HangReport
from stalwart.monitor.suspicions import Late, Suspicions
from stalwart.monitor.timer_server import TimerServer

log = logging.getLogger(__name__)

#: The scanner looks this soon after a rank's deadline (a timestamp written a moment
#: late must not make it look twice), and never more often than every DEADLINE_MIN_WAIT.
#: Ranks whose deadlines are within BLAME_RESOLUTION are then found hung in one scan, so
#: `blame` compares them all (found alone, the first one would be the root cause).
DEADLINE_SLACK = 0.002 + BLAME_RESOLUTION
DEADLINE_MIN_WAIT = 0.005


def _waiting(reading: Reading | None) -> bool | None:
    if reading is None or reading.role is Role.UNKNOWN:
        return None
    return reading.role is Role.WAITING


def _late(rank: Rank, writer: int, past: bool) -> Late:
    look = rank.lookout
    if look is None:  # judge found a deadline, so lookout did too; kept safe regardless
        return Late(writer, -1.0, rank.due or 0.0, past)
    return Late(writer, look.since, look.due, past)


def scan_wait(dues: Iterable[float | None], now: float, interval: float) -> float:
    """How long the scanner may sleep, given the armed ranks' deadlines: the check
    interval, or less when a deadline passes sooner (then it looks just after it, not up
    to an interval later). Deadlines already past (a rank being handled, or one that
    exited) do not count, and the scanner never looks more often than DEADLINE_MIN_WAIT."""
    ahead = [due for due in dues if due and due > now]
    if not ahead:
        return interval
    return min(interval, max(DEADLINE_MIN_WAIT, min(ahead) - now + DEADLINE_SLACK))


class NodeMonitor:
    """One per node. See docs/monitor.md for the supervisor contract."""

    def __init__(
        self,
        run_dir: Path,
        config: MonitorConfig,
        local_world_size: int,
        log_event: LogEvent,
        state_dir: Path | None = None,
    ) -> None:
        """state_dir: the job's run folder, where timeouts learned with ``auto`` are kept
        (and read back from at start, so they survive a restart) and hang dossiers are
        written; None keeps neither."""
        if local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
        self.run_dir = Path(run_dir)
        self.config = config
        self.local_world_size = local_world_size
        self.shm_path = self.run_dir / SHM_NAME
        self.pipe_path = self.run_dir / PIPE_NAME
        self._emit = EventSink(log_event)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._scanner: threading.Thread | None = None
        # When the last whole scan began, for callers that must know the monitor had its
        # chance to judge a moment (wait_scanned_since).
        self._scanned = threading.Condition()
        self._last_scan_began = -math.inf
        self._ranks = AttemptRanks()
        self._slots = Slots(self.shm_path, local_world_size, self._emit)
        self._hangs = HangHandler(
            config, self._ranks, self._slots, self._emit, state_dir, self._wake.set
        )
        self._desk = RequestDesk(self._ranks, self._slots, self._emit, self._on_hung_timer)
        learned_path = state_dir / LEARNED_NAME if state_dir is not None else None
        self._learning = Learning(config, learned_path, self._emit, self._learned_changed)
        self._stragglers = StragglerWatch(config, self._emit, self._desk.add, self._ranks.pid_of)
        self._sync = JobSync(config, self._learning, self._stragglers)
        # Ranks past a learned deadline, until evidence says they are hung (or not).
        self._suspicions = Suspicions(ask_stacks)
        self._timers = TimerServer(
            self.pipe_path,
            on_expired=self._desk.on_timer_expired,
            on_control=self._desk.on_control,
            log_event=self._emit,
            max_interval=min(config.check_interval, 0.1),
        )

    def _on_hung_timer(self, rank: Rank, target: int, verdict: Verdict, signal: int) -> None:
        self._hangs.begin(rank, target, verdict, signal)
        self._wake.set()

    def _learned_changed(self) -> None:
        self._sync.wake()  # the other nodes hear of it without waiting a poll

    # -- lifecycle (supervisor thread) -----------------------------------------------
    def start(self) -> None:
        ensure_private_dir(self.run_dir)
        self._slots.create()
        if self.config.any_auto:
            self._learning.read()
        self._timers.start()
        self._stop.clear()
        self._sync.start()
        self._scanner = threading.Thread(
            target=self._scan_loop, name="stalwart-monitor", daemon=True
        )
        self._scanner.start()
        self._emit(
            Event.MONITOR_STARTED, {"config": self.config.to_dict(), "run_dir": str(self.run_dir)}
        )

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._scanner is not None:
            self._scanner.join(timeout=5)
            self._scanner = None
        self._sync.close()
        self._hangs.run_due(force=True)
        self._timers.stop(remove=True)
        self._slots.close()
        with contextlib.suppress(OSError):
            self.run_dir.rmdir()  # only if nothing else lives there

    def worker_env(self, local_rank: int, global_rank: int) -> dict[str, str]:
        if not 0 <= local_rank < self.local_world_size:
            raise ValueError(f"local_rank {local_rank} outside 0..{self.local_world_size - 1}")
        pipe = str(self.pipe_path)
        self._ranks.name(local_rank, global_rank)
        return {
            envvars.TIMER_FILE: pipe,
            envvars.TORCHELASTIC_TIMER_FILE: pipe,
            envvars.SHM_FILE: str(self.shm_path),
            envvars.SLOT: str(local_rank),
            envvars.GLOBAL_RANK: str(global_rank),
            envvars.SAFETY_FACTOR: repr(self.config.safety_factor),
            envvars.TIMEOUTS: json.dumps(
                {
                    "hb_initial": self.config.effective_initial_timeout,
                    "hb": self.config.hb_timeout,
                    "sections": dict(self.config.section_timeouts),
                    "oos": self.config.out_of_section_timeout,
                },
                separators=(",", ":"),
            ),
        }

    def join_job(self, peers: JobPeers | None) -> None:
        """The job's other nodes for the round about to start (call before its
        begin_attempt): learned timeouts and straggler windows are shared with them
        through `peers.store` from now on. None, or a one-node round: nothing is shared."""
        self._sync.join(peers)

    def begin_attempt(
        self,
        attempt: int,
        pids: dict[int, int],
        stderr_paths: dict[int, Path] | None = None,
        global_ranks: dict[int, int] | None = None,
    ) -> None:
        """Starts judging the workers of a fresh attempt (local_rank -> pid)."""
        self._stragglers.new_attempt()
        self._desk.new_attempt()
        self._hangs.new_attempt()
        self._learning.new_attempt()
        self._suspicions.reset()
        self._ranks.begin(attempt, pids, stderr_paths or {}, global_ranks)
        self._emit(
            Event.MONITOR_ATTEMPT_STARTED,
            {"attempt": attempt, "pids": {str(k): v for k, v in pids.items()}},
        )
        self._desk.resolve()

    def end_attempt(self) -> None:
        """Stops judging: the supervisor is tearing the workers down.

        A hang still waiting for its stack dump is reported now, so the supervisor's next
        poll_hangs() sees every hang of the attempt it is ending.
        """
        for rank in self._ranks.end():
            self._timers.forget_pid(rank.pid)
        self._suspicions.reset()
        self._slots.rebuild()
        self._hangs.end_attempt()

    def poll_hangs(self) -> list[HangReport]:
        return self._hangs.poll()

    def poll_requests(self) -> list[ControlRequest]:
        return self._desk.poll()

    def wait_scanned_since(self, since: float, timeout: float) -> bool:
        """Waits until a whole scan that began at or after *since* (``time.monotonic``)
        is done: every deadline due by then has been judged.  False after *timeout*
        seconds without one (the scanner stopped or is starved)."""
        with self._scanned:
            return self._scanned.wait_for(lambda: self._last_scan_began >= since, timeout)

    # -- scanner thread --------------------------------------------------------------
    def _scan_loop(self) -> None:
        interval = self.config.check_interval
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.scan_once()
                self._hangs.run_due()
            except Exception:
                log.exception("monitor scan failed")
            with self._scanned:
                self._last_scan_began = began
                self._scanned.notify_all()
            now = time.monotonic()
            wait = scan_wait(self._wake_times(), now, interval)
            due = self._hangs.next_due()
            if due is not None:
                wait = max(0.0, min(wait, due - time.monotonic()))
            self._wake.wait(wait)
            self._wake.clear()

    def _wake_times(self) -> list[float | None]:
        """The armed ranks' deadlines and, in evidence mode, their first looks and the
        second looks due: the times the scanner must not sleep past."""
        times: list[float | None] = []
        for rank in self._ranks.armed():
            times.append(rank.due)
            if rank.lookout is not None:
                times.append(rank.lookout.look)
        times.append(self._suspicions.next_look())
        return times

    def scan_once(self) -> None:
        """Judges every armed rank once (the scanner thread calls this each interval)."""
        mm = self._slots.mapping
        if mm is None:
            return
        ranks = self._ranks.armed()
        found: dict[int, tuple[Rank, int, Verdict]] = {}
        # Evidence mode: ranks late by their rhythm, not yet past their deadline.
        early: dict[int, tuple[Rank, int]] = {}
        for rank in ranks:
            verdict, writer = self._judge_rank(mm, rank)
            if verdict is None:
                look = rank.lookout
                if look is not None and look.look <= time.monotonic() and procs.is_alive(writer):
                    early[rank.local_rank] = (rank, writer)
                continue
            # Re-read once: a slot field read mid-update must not be taken for a hang.
            again, _ = self._judge_rank(mm, rank)
            if again is None or again.kind != verdict.kind:
                continue
            if not procs.is_alive(writer):
                continue  # it exited; the supervisor sees the exit, not a hang
            found[rank.local_rank] = (rank, writer, verdict)
        if self.config.any_auto:
            self._learning.update()
        window = self._stragglers.measure(ranks, self._ranks.attempt, time.monotonic())
        if window is not None and not self._sync.offer(window):
            self._stragglers.judge_alone(window)
        readings: dict[int, Reading] = {}
        if self.config.needs_evidence:
            # A missed deadline is a suspicion; only evidence makes it a hang.
            late = {lr: _late(rank, writer, False) for lr, (rank, writer) in early.items()}
            late.update({lr: _late(rank, writer, True) for lr, (rank, writer, _) in found.items()})
            readings = self._suspicions.confirm(late, self._ranks.watched(), time.monotonic())
            # Victims judged with their culprit before their own deadline passed.
            for rank in ranks:
                if rank.local_rank in readings and rank.local_rank not in found:
                    verdict, writer = self._judge_rank(mm, rank, early=True)
                    if verdict is not None and procs.is_alive(writer):
                        found[rank.local_rank] = (rank, writer, verdict)
            found = {lr: found[lr] for lr in readings if lr in found}
        if not found:
            return
        # Handled root cause first, and every other one named as waiting on it; ranks
        # found in earlier scans of this attempt take part (their hang is under way).
        fresh = [
            Stalled(
                r.local_rank,
                r.global_rank,
                v.iteration,
                v.stalled_since,
                v.last_active,
                # Read before any hang is handled (that continues a stopped process).
                stopped=procs.is_stopped(writer),
                waiting=_waiting(readings.get(r.local_rank)),
                why=readings[r.local_rank].where if r.local_rank in readings else None,
            )
            for r, writer, v in found.values()
        ]
        order = self._hangs.blame(fresh)
        root = order[0]
        for s in order:
            if not any(s is f for f in fresh):
                continue
            rank, writer, verdict = found[s.local_rank]
            waiting = None if s is root else root.global_rank
            self._hangs.begin(
                rank, writer, verdict, int(self.config.term_signal), waiting_on=waiting, stalled=s
            )

    def _judge_rank(
        self, mm: mmap.mmap, rank: Rank, early: bool = False
    ) -> tuple[Verdict | None, int]:
        """The verdict on one read of the rank's slot and the pid that wrote it (0: no
        believable writer). early: the verdict of its nearest deadline even before it
        passed (a victim judged with its culprit)."""
        rank.lookout = None  # a slot without a believable writer is not looked at
        snap = layout.read_slot(mm, rank.local_rank)
        if snap.pid <= 0:
            return None, 0
        if snap.pid != rank.pid and snap.pid not in rank.verified_pids:
            # Written by a process of an earlier attempt, or by a child of our worker.
            if snap.pid in rank.foreign_pids or not procs.is_descendant(snap.pid, rank.pid):
                rank.foreign_pids.add(snap.pid)
                return None, 0
            rank.verified_pids[snap.pid] = procs.start_time(snap.pid)
        key = (snap.pid, snap.attach_time, snap.name_count)
        if key != rank.names_key:
            rank.names = layout.read_names(mm, rank.local_rank, snap.name_count)
            rank.names_key = key
        now = time.monotonic()
        floor = self._slots.floor
        bad = problems(snap, floor, now)
        if bad:
            self._slots.note_bad_fields(rank.local_rank, snap.pid, bad)
        if (
            not bad
            and snap.iteration >= 0
            and (not rank.progress or rank.progress[-1][1] != snap.iteration)
        ):
            rank.progress.append((now, snap.iteration))
        config = self.config
        if config.any_auto and not bad:
            config = self._learning.judged_by(rank.local_rank, snap, rank.names, now)
        rank.due = next_deadline(snap, rank.names, config, now, floor)
        if self.config.needs_evidence:
            rank.lookout = lookout(snap, rank.names, config, now, floor, evidence.CONFIRM_WAIT)
        verdict = (judged_early if early else judge)(snap, rank.names, config, now, floor)
        return verdict, snap.pid
