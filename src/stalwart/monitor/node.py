"""`NodeMonitor`: the launcher-side owner of one node's hang detection.

It creates the per-run folder (0700), the shared-memory segment and the timer pipe
(0600), and runs two threads: the timer server and a scanner that judges every armed
rank's slot each `check_interval`. A hung rank is asked for its stacks (SIGUSR1, with
SIGCONT in case it is stopped), then sent the terminate signal, then SIGKILL after the
grace period; a `HangReport` is queued for the supervisor and a `hang_detected` event
logged. Never imports the launcher: the supervisor drives it through the methods below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from stalwart.base import procs
from stalwart.base.events import Event
from stalwart.base.files import untrusted
from stalwart.monitor import auto, dossier, envvars, jobsync, layout
from stalwart.monitor.config import MonitorConfig
from stalwart.monitor.jobsync import JobPeers, NodeRhythm
from stalwart.monitor.judge import (
    Stalled,
    Verdict,
    blame,
    judge,
    next_deadline,
    problems,
    stragglers,
)
from stalwart.monitor.learned import LearnedTimeouts
from stalwart.monitor.reports import ControlAction, ControlRequest, HangKind, HangReport
from stalwart.monitor.timer_server import ExpiredTimer, TimerServer
from stalwart.monitor.wire import ControlMessage

log = logging.getLogger(__name__)

LogEvent = Callable[[Event, dict[str, Any]], None]

SHM_NAME = "monitor.shm"
PIPE_NAME = "timer.pipe"
STACKS_MAX_BYTES = 64 * 1024
STACKS_POLL = 0.02
STACKS_MAX_WAIT_FACTOR = 5
#: Refused pids remembered so that each is logged once (then the set starts afresh).
MAX_REFUSED_LOGGED = 4096
#: Control requests held while their sender is not (yet) a registered worker.
MAX_PENDING_CONTROLS = 64
#: Seconds a control request from a live, not yet registered pid waits for its attempt.
CONTROL_GRACE = 5.0
#: Largest learned-timeouts file read back from the run folder.
MAX_LEARNED_BYTES = jobsync.MAX_VALUE_BYTES
LEARNED_NAME = "learned_timeouts.json"
#: The scanner looks this soon after a rank's deadline (a timestamp written a moment
#: late must not make it look twice), and never more often than every DEADLINE_MIN_WAIT.
DEADLINE_SLACK = 0.002
DEADLINE_MIN_WAIT = 0.005
#: A rank is named a straggler on the console at most this often (seconds).
STRAGGLER_LOG_EVERY = 60.0


@dataclasses.dataclass
class _Rank:
    local_rank: int
    global_rank: int
    pid: int
    start_time: int | None
    stderr: Path | None
    # Descendants seen writing the slot or holding a timer -> their start time, so a pid
    # the kernel reuses for an unrelated process is not taken for them.
    verified_pids: dict[int, int | None] = dataclasses.field(default_factory=dict)
    foreign_pids: set[int] = dataclasses.field(default_factory=set)
    names: list[str] = dataclasses.field(default_factory=list)
    names_key: tuple[int, float, int] = (0, 0.0, 0)  # (pid, attach time, count) they were read at
    judged: bool = True  # False once a hang was handled: one report per rank and attempt
    due: float | None = None  # when its earliest deadline passes, as of the last read
    # (monotonic time, iteration) whenever the iteration moved: the straggler check's input
    progress: list[tuple[float, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Window:
    """A straggler window of this node, waiting to be compared with the job's."""

    rhythm: NodeRhythm
    local_ranks: dict[int, int]  # global -> local rank
    attempt: int | None


@dataclasses.dataclass
class _Hang:
    """A hang being handled: stacks requested, then terminate, then kill."""

    rank: _Rank
    target: int  # the process that writes the slot (or holds the timer)
    verdict: Verdict
    term_signal: int
    stderr_offset: int | None
    detected_at: float
    attempt: int | None = None
    dump_sent_at: float = 0.0
    last_size: int = -1
    terminated: bool = False
    waiting_on: int | None = None
    dossier: Path | None = None
    deferred_since: float | None = None  # monotonic: waiting for the rank it waited on


def _ensure_private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    problem = untrusted(os.lstat(path), "folder", private=False)
    if problem is not None:
        raise PermissionError(f"monitor folder {path}: {problem}")
    os.chmod(path, 0o700)


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
        self._log_event = log_event
        self.shm_path = self.run_dir / SHM_NAME
        self.pipe_path = self.run_dir / PIPE_NAME
        self._mm: Any = None
        self._retired: list[Any] = []
        self._floor = 0.0  # monotonic time the segment was made: no slot time is older
        self._bad_fields: set[tuple[int, str]] = set()  # (local rank, field) logged once
        self._lock = threading.RLock()
        self._event_lock = threading.Lock()
        self._ranks: dict[int, _Rank] = {}
        self._global_ranks: dict[int, int] = {}
        self._attempt: int | None = None
        # Ranks found hung this attempt, so that one found later is compared with them.
        self._stalled: list[Stalled] = []
        self._roots: dict[int, _Hang] = {}  # global rank -> its hang, this attempt
        self._hangs: list[HangReport] = []
        self._requests: list[ControlRequest] = []
        self._pending_controls: list[tuple[ControlMessage, float]] = []
        self._refused_pids: set[int] = set()
        # pid -> start time of processes found not to descend from a worker (this attempt).
        self._not_ours: dict[int, int] = {}
        # (due, seq, step, hang): steps run on the scanner thread, in due order.
        self._schedule: list[tuple[float, int, str, _Hang]] = []
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._scanner: threading.Thread | None = None
        self._state_dir = state_dir
        self._straggler_due = 0.0
        self._straggler_logged: dict[int, float] = {}  # global rank -> last console line
        self._learned_path = state_dir / LEARNED_NAME if state_dir is not None else None
        # The hang dossier of the current attempt: every rank's state and stack offsets.
        self._dossier: dict[int, dossier.RankEntry] | None = None
        self._learned = LearnedTimeouts()
        self._learned_lock = threading.Lock()  # one writer of the learned-timeouts file
        # Sharing with the job's other nodes (see monitor.jobsync): set per round.
        self._peers: JobPeers | None = None
        self._sync_wake = threading.Event()
        self._syncer: threading.Thread | None = None
        # Sync thread only: the round it shares in, what the job's store is known to hold
        # in it (ours and others' values; ours is published only when it adds to that),
        # and the store's change counter when last read.
        self._sync_round: int | None = None
        self._job_known = LearnedTimeouts()
        self._seen_version = -1
        self._window_seq = 0
        self._freshness = jobsync.Freshness(2 * config.straggler_window)
        self._window: _Window | None = None  # the last window, for the sync thread
        self._sync_warned: set[str] = set()
        self._exclusion_asked = False  # --straggler-restart: once per attempt
        self._rhythms: dict[int, auto.Rhythm] = {}
        self._auto = auto.AutoSettings(
            hb=config.hb_auto,
            sections=config.section_auto,
            oos=config.oos_auto,
            warmup_steps=config.auto_warmup_steps,
            warmup_seconds=config.auto_warmup_seconds,
            percentile=config.auto_percentile,
            factor=config.safety_factor,
            floor=config.auto_floor,
        )
        self._timers = TimerServer(
            self.pipe_path,
            on_expired=self._on_timer_expired,
            on_control=self._on_control,
            log_event=self._emit,
            max_interval=min(config.check_interval, 0.1),
        )

    # -- lifecycle (supervisor thread) -----------------------------------------------
    def start(self) -> None:
        _ensure_private_dir(self.run_dir)
        if self.shm_path.exists() or self.shm_path.is_symlink():
            self.shm_path.unlink()  # left by an earlier monitor of this run: never reuse
        self._mm = layout.create_segment(self.shm_path, self.local_world_size)
        self._floor = time.monotonic()
        if self.config.any_auto:
            self._read_learned()
        self._timers.start()
        self._stop.clear()
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
        self._sync_wake.set()
        if self._scanner is not None:
            self._scanner.join(timeout=5)
            self._scanner = None
        if self._syncer is not None:
            # A store call that hangs is bounded by the store's own timeout; the thread
            # is a daemon and cannot hold the launcher's exit.
            self._syncer.join(timeout=5)
            self._syncer = None
        self._run_due(force=True)
        self._timers.stop(remove=True)
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        for old in self._retired:
            old.close()
        self._retired = []
        self.shm_path.unlink(missing_ok=True)
        self.shm_path.with_name(SHM_NAME + ".next").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.run_dir.rmdir()  # only if nothing else lives there

    def worker_env(self, local_rank: int, global_rank: int) -> dict[str, str]:
        if not 0 <= local_rank < self.local_world_size:
            raise ValueError(f"local_rank {local_rank} outside 0..{self.local_world_size - 1}")
        pipe = str(self.pipe_path)
        with self._lock:
            self._global_ranks[local_rank] = global_rank
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
        if peers is not None and peers.nnodes < 2:
            peers = None
        with self._lock:
            self._peers = peers
            self._window = None
        if peers is not None and self._syncer is None and not self._stop.is_set():
            self._syncer = threading.Thread(
                target=self._sync_loop, name="stalwart-monitor-sync", daemon=True
            )
            self._syncer.start()
        self._sync_wake.set()

    def begin_attempt(
        self,
        attempt: int,
        pids: dict[int, int],
        stderr_paths: dict[int, Path] | None = None,
        global_ranks: dict[int, int] | None = None,
    ) -> None:
        """Starts judging the workers of a fresh attempt (local_rank -> pid)."""
        stderr_paths = stderr_paths or {}
        with self._lock:
            self._exclusion_asked = False
            self._refused_pids.clear()
            self._not_ours.clear()
            self._stalled = []
            self._roots = {}
            self._rhythms = {}
            self._dossier = None
            self._attempt = attempt
            self._ranks = {
                lr: _Rank(
                    local_rank=lr,
                    global_rank=(global_ranks or self._global_ranks).get(lr, -1),
                    pid=pid,
                    start_time=procs.start_time(pid),
                    stderr=Path(stderr_paths[lr]) if lr in stderr_paths else None,
                )
                for lr, pid in pids.items()
            }
        self._emit(
            Event.MONITOR_ATTEMPT_STARTED,
            {"attempt": attempt, "pids": {str(k): v for k, v in pids.items()}},
        )
        self._resolve_controls()

    def end_attempt(self) -> None:
        """Stops judging: the supervisor is tearing the workers down.

        A hang still waiting for its stack dump is reported now, so the supervisor's next
        poll_hangs() sees every hang of the attempt it is ending.
        """
        with self._lock:
            for rank in self._ranks.values():
                self._timers.forget_pid(rank.pid)
            self._ranks = {}
            self._attempt = None
            self._stalled = []
            self._roots = {}  # pending hangs below are terminated now, in no order
            self._rebuild_segment()
            # The pending hangs below still write the dossier of the attempt they belong to.
            pending = [item for item in self._schedule if item[2] != "kill"]
            self._schedule = [item for item in self._schedule if item[2] == "kill"]
            heapq.heapify(self._schedule)
        for _, _, _, hang in sorted(pending, key=lambda item: item[:2]):
            self._terminate(hang)

    def _rebuild_segment(self) -> None:
        """Gives the next attempt a fresh segment (called with the lock held, before its
        workers start): nothing a worker of this one scribbled, header included, carries
        over, and its leftover processes write into a file nobody reads."""
        if self._mm is None:
            return
        fresh = self.shm_path.with_name(SHM_NAME + ".next")
        try:
            fresh.unlink(missing_ok=True)
            mm = layout.create_segment(fresh, self.local_world_size)
            os.replace(fresh, self.shm_path)
        except OSError as exc:
            # E.g. a full tmpfs: reuse the mapping, rewriting what a worker may have scribbled.
            log.warning("could not make a fresh monitor segment (%s); resetting it in place", exc)
            with contextlib.suppress(OSError):
                fresh.unlink(missing_ok=True)
            layout.reset_segment(self._mm, self.local_world_size)
            self._floor = time.monotonic()
            self._bad_fields.clear()
            return
        # The scanner may still be reading the old mapping: close it one rebuild later.
        for old in self._retired:
            old.close()
        self._retired = [self._mm]
        self._mm = mm
        self._floor = time.monotonic()
        self._bad_fields.clear()

    def poll_hangs(self) -> list[HangReport]:
        with self._lock:
            out, self._hangs = self._hangs, []
        return out

    def poll_requests(self) -> list[ControlRequest]:
        self._resolve_controls()
        with self._lock:
            out, self._requests = self._requests, []
        return out

    # -- helpers ---------------------------------------------------------------------
    def _emit(self, event: Event, fields: dict[str, Any]) -> None:
        try:
            with self._event_lock:
                self._log_event(event, fields)
        except Exception:  # a broken sink must not stop hang detection
            log.exception("log_event(%s) failed", event)

    def _rank_of_pid(self, pid: int) -> _Rank | None:
        """The rank `pid` is, or descends from; None for any other process."""
        with self._lock:
            for rank in self._ranks.values():
                if pid == rank.pid:
                    return rank
            started = procs.start_time(pid)
            for rank in self._ranks.values():
                if pid in rank.verified_pids and rank.verified_pids[pid] == started:
                    return rank
            if started is not None and self._not_ours.get(pid) == started:
                return None  # same process as last time: a walk up /proc would say no again
            for rank in self._ranks.values():
                if procs.is_descendant(pid, rank.pid):
                    rank.verified_pids[pid] = started
                    return rank
            if started is not None:
                if len(self._not_ours) >= MAX_REFUSED_LOGGED:
                    self._not_ours.clear()
                self._not_ours[pid] = started
        return None

    def _same_process(self, rank: _Rank, pid: int) -> bool:
        if pid != rank.pid:
            if pid in rank.verified_pids:
                return procs.start_time(pid) == rank.verified_pids[pid] and procs.is_alive(pid)
            return procs.is_alive(pid)
        return rank.start_time is None or procs.start_time(pid) == rank.start_time

    # -- scanner thread --------------------------------------------------------------
    def _scan_loop(self) -> None:
        interval = self.config.check_interval
        while not self._stop.is_set():
            try:
                self.scan_once()
                self._run_due()
            except Exception:
                log.exception("monitor scan failed")
            wait = self._until_next_deadline(interval)
            with self._lock:
                if self._schedule:
                    wait = max(0.0, min(wait, self._schedule[0][0] - time.monotonic()))
            self._wake.wait(wait)
            self._wake.clear()

    def _until_next_deadline(self, interval: float) -> float:
        """How long the scanner may sleep: the check interval, or less when a rank's
        deadline passes sooner (then it looks just after it, not up to an interval
        later). Deadlines already past (a rank being handled, or one that exited) do
        not count, and the scanner never looks more often than DEADLINE_MIN_WAIT."""
        now = time.monotonic()
        with self._lock:
            ahead = [r.due for r in self._ranks.values() if r.judged and r.due and r.due > now]
        if not ahead:
            return interval
        return min(interval, max(DEADLINE_MIN_WAIT, min(ahead) - now + DEADLINE_SLACK))

    def scan_once(self) -> None:
        """Judges every armed rank once (the scanner thread calls this each interval)."""
        mm = self._mm
        if mm is None:
            return
        with self._lock:
            ranks = [r for r in self._ranks.values() if r.judged]
        found: dict[int, tuple[_Rank, int, Verdict]] = {}
        for rank in ranks:
            verdict, writer = self._judge_rank(mm, rank)
            if verdict is None:
                continue
            # Re-read once: a slot field read mid-update must not be taken for a hang.
            again, _ = self._judge_rank(mm, rank)
            if again is None or again.kind != verdict.kind:
                continue
            if not procs.is_alive(writer):
                continue  # it exited; the supervisor sees the exit, not a hang
            found[rank.local_rank] = (rank, writer, verdict)
        if self.config.any_auto:
            self._update_learned()
        self._check_stragglers(ranks)
        if not found:
            return
        # Handled root cause first, and every other one named as waiting on it; ranks
        # found in earlier scans of this attempt take part (their hang is under way).
        fresh = [
            Stalled(r.local_rank, r.global_rank, v.iteration, v.stalled_since)
            for r, _, v in found.values()
        ]
        with self._lock:
            order = blame(self._stalled + fresh)
        root = order[0]
        for s in order:
            if not any(s is f for f in fresh):
                continue
            rank, writer, verdict = found[s.local_rank]
            waiting = None if s is root else root.global_rank
            self._begin_hang(
                rank, writer, verdict, int(self.config.term_signal), waiting_on=waiting, stalled=s
            )

    def _judge_rank(self, mm: Any, rank: _Rank) -> tuple[Verdict | None, int]:
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
        bad = problems(snap, self._floor, now)
        if bad:
            self._note_bad_fields(rank, snap.pid, bad)
        if (
            not bad
            and snap.iteration >= 0
            and (not rank.progress or rank.progress[-1][1] != snap.iteration)
        ):
            rank.progress.append((now, snap.iteration))
        config = self.config
        if config.any_auto and not bad:
            rhythm = self._rhythms.get(rank.local_rank)
            if rhythm is None:
                rhythm = auto.Rhythm(settle=self._auto.warmup_steps // 2)
                self._rhythms[rank.local_rank] = rhythm
            warm = rhythm.warm(self._auto.warmup_steps, self._auto.warmup_seconds, now)
            if rhythm.observe(snap, rank.names, now, relearn=warm):
                log.info("rank %d opened a new section: learning its rhythm again", rank.local_rank)
            config = self._config_for(rhythm, now)
        rank.due = next_deadline(snap, rank.names, config, now, self._floor)
        return judge(snap, rank.names, config, now, self._floor), snap.pid

    # -- stragglers -------------------------------------------------------------------
    def _check_stragglers(self, ranks: list[_Rank]) -> None:
        """Every straggler_window: measures the ranks' seconds per step over the window
        just ended; compares them with the node's other ranks, or, when the job has
        other nodes, hands them to the sync thread to compare with the job's."""
        now = time.monotonic()
        window = self.config.straggler_window
        if self._straggler_due == 0.0:
            self._straggler_due = now + window
        if now < self._straggler_due:
            return
        self._straggler_due = now + window
        step_times: dict[int, float] = {}
        local: dict[int, int] = {}
        for rank in ranks:
            recent = [p for p in rank.progress if p[0] >= now - window]
            rank.progress = recent[-1:]  # the window's last point starts the next one
            if len(recent) >= 2 and recent[-1][1] > recent[0][1]:
                step_times[rank.global_rank] = (recent[-1][0] - recent[0][0]) / (
                    recent[-1][1] - recent[0][1]
                )
                local[rank.global_rank] = rank.local_rank
        mine = NodeRhythm(socket.gethostname(), window, step_times)
        with self._lock:
            shared = self._peers is not None
            if shared:
                self._window = _Window(mine, local, self._attempt)
        if shared:
            self._sync_wake.set()
            return
        self._report_stragglers(
            stragglers(step_times, self.config.straggler_factor),
            step_times,
            dict.fromkeys(step_times, mine.host),
            _Window(mine, local, self._attempt),
            None,
        )

    def _report_stragglers(
        self,
        verdicts: dict[int, float],
        step_times: dict[int, float],
        hosts: dict[int, str],
        mine: _Window,
        peers: JobPeers | None,
        nodes: int = 1,
    ) -> None:
        """Names this node's ranks among `verdicts` (event each window, console
        rate-limited); with ``straggler_restart`` asks once to exclude this node."""
        now = time.monotonic()
        window = mine.rhythm.window
        scope = "the node's" if peers is None else "the job's"
        for global_rank, ratio in sorted(verdicts.items()):
            if global_rank not in mine.local_ranks:
                continue  # another node's rank: that node names it
            fields = {
                "global_rank": global_rank,
                "local_rank": mine.local_ranks[global_rank],
                "host": hosts[global_rank],
                "ratio": round(ratio, 3),
                "step_time": step_times[global_rank],
                "window": window,
                "attempt": mine.attempt,
                "ranks_compared": len(step_times),
                "nodes_compared": nodes,
            }
            self._emit(Event.STRAGGLER, fields)
            last = self._straggler_logged.get(global_rank)
            if last is None or now - last >= STRAGGLER_LOG_EVERY:
                self._straggler_logged[global_rank] = now
                log.warning(
                    "rank %d on %s is a straggler: %.1fx slower per step than %s other "
                    "ranks over the last %.0f s",
                    global_rank,
                    fields["host"],
                    ratio,
                    scope,
                    window,
                )
            if self.config.straggler_restart:
                self._ask_exclusion(global_rank, mine.local_ranks[global_rank], ratio, peers)

    def _ask_exclusion(
        self, global_rank: int, local_rank: int, ratio: float, peers: JobPeers | None
    ) -> None:
        """``straggler_restart``: the node of a straggler leaves the job and the others
        restart without it, by the same path as a rank's request to exclude its node."""
        with self._lock:
            if self._exclusion_asked:
                return
            self._exclusion_asked = True
            rank = self._ranks.get(local_rank)
        if peers is None or not peers.elastic:
            log.warning(
                "rank %d is a straggler, but only a job of elastic membership (--nnodes "
                "MIN:MAX with another node) can go on without its node: not restarting",
                global_rank,
            )
            return
        reason = (
            f"rank {global_rank} is a straggler ({ratio:.1f}x slower per step than the job's "
            "other ranks; --straggler-restart)"
        )
        req = ControlRequest(
            action=ControlAction.EXCLUDE_NODE,
            global_rank=global_rank,
            local_rank=local_rank,
            pid=rank.pid if rank is not None else 0,
            received_at=time.time(),
            reason=reason,
        )
        with self._lock:
            self._requests.append(req)
        log.warning("%s: asking to restart the job without this node", reason)

    # -- the job's store: sharing with the other nodes ----------------------------------
    def _sync_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                peers = self._peers
            if peers is not None:
                try:
                    self._sync_once(peers)
                except Exception as exc:  # a lost store is the supervisor's to act on
                    self._sync_warn("store", "could not share monitor state with the job: %s", exc)
            self._sync_wake.wait(jobsync.SYNC_EVERY)
            self._sync_wake.clear()

    def _sync_warn(self, key: str, fmt: str, *args: Any) -> None:
        if key not in self._sync_warned:
            self._sync_warned.add(key)
            log.warning(fmt, *args)

    def _sync_once(self, peers: JobPeers) -> None:
        if peers.round != self._sync_round:  # a new round's keys: publish again, read again
            self._sync_round, self._job_known, self._seen_version = (
                peers.round,
                LearnedTimeouts(),
                -1,
            )
            self._window_seq = 0
            # Two windows without news: that node is not compared with any more.
            self._freshness = jobsync.Freshness(2 * self.config.straggler_window)
        if self.config.any_auto:
            self._sync_learned(peers)
        with self._lock:
            window, self._window = self._window, None
        if window is not None:
            self._sync_window(peers, window)

    def _sync_window(self, peers: JobPeers, window: _Window) -> None:
        """Publishes this node's straggler window, compares it with the other nodes'
        latest ones, and names this node's stragglers. A window in which no rank of
        this node moved (finished, or hung: the hang checks' business) is not published:
        the others keep comparing with the last one that measured something."""
        store, r = peers.store, peers.round
        if not window.rhythm.step_times:
            return
        self._window_seq += 1
        mine = msgspec.structs.replace(window.rhythm, seq=self._window_seq)
        store.set(jobsync.rhythm_key(r, peers.node_rank), mine.encode())
        nodes = [n for n in range(peers.nnodes) if n != peers.node_rank]
        keys = [jobsync.rhythm_key(r, n) for n in nodes]
        others: list[tuple[int, NodeRhythm]] = []
        now = time.monotonic()
        for node, key, raw in zip(nodes, keys, store.get_many(keys), strict=True):
            if raw is None:
                continue
            try:
                other = jobsync.decode_rhythm(raw)
                if self._freshness.fresh(node, other.seq, now):
                    others.append((node, other))
            except ValueError as exc:
                self._sync_warn(key, "ignoring a straggler window at store key %s: %s", key, exc)
        steps, hosts = jobsync.pool_rhythms(window.rhythm, peers.node_rank, others)
        verdicts = stragglers(steps, self.config.straggler_factor)
        self._report_stragglers(verdicts, steps, hosts, window, peers, 1 + len(others))

    def _sync_learned(self, peers: JobPeers) -> None:
        """Publishes this node's learned timeouts when they changed; reads the others'
        when any changed (one counter read per poll otherwise) and applies the maximum."""
        store, r = peers.store, peers.round
        with self._lock:
            mine = self._learned
        if auto.merge(self._job_known, mine) != self._job_known:
            store.set(jobsync.learned_key(r, peers.node_rank), jobsync.encode_learned(mine))
            store.add(jobsync.learned_version_key(r), 1)
            self._job_known = auto.merge(self._job_known, mine)
        version = store.add(jobsync.learned_version_key(r), 0)
        if version == self._seen_version:
            return
        self._seen_version = version
        keys = [jobsync.learned_key(r, n) for n in range(peers.nnodes) if n != peers.node_rank]
        job = LearnedTimeouts()
        for key, raw in zip(keys, store.get_many(keys), strict=True):
            if raw is None:
                continue
            try:
                job = auto.merge(job, jobsync.decode_learned(raw))
            except ValueError as exc:
                self._sync_warn(key, "ignoring learned timeouts at store key %s: %s", key, exc)
        self._job_known = auto.merge(self._job_known, job)
        self._fold_learned(job, "job")

    # -- learned (auto) timeouts -------------------------------------------------------
    def _config_for(self, rhythm: auto.Rhythm, now: float) -> MonitorConfig:
        """The config a rank is judged by: learned values once it warmed up, the initial
        timeout before; numbers the user gave stay as they are."""
        c, a = self.config, self._auto
        warm = rhythm.warm(a.warmup_steps, a.warmup_seconds, now)
        pre = c.auto_initial_timeout
        learned = self._learned
        hb = c.hb_timeout
        if a.hb:
            hb = learned.hb if warm and learned.hb is not None else pre
        oos = c.out_of_section_timeout
        if a.oos:
            oos = learned.oos if warm and learned.oos is not None else pre
        sections = dict(c.section_timeouts)
        if a.sections:
            for name in rhythm.names:
                if name not in sections:
                    value = learned.sections.get(name)
                    sections[name] = value if warm and value is not None else pre
        initial = c.effective_initial_timeout
        if hb is not None and initial is not None and initial < hb:
            initial = hb
        return dataclasses.replace(
            c,
            hb_timeout=hb,
            hb_initial_timeout=initial,
            out_of_section_timeout=oos,
            section_timeouts=sections,
        )

    def _update_learned(self) -> None:
        """Folds what warmed-up ranks showed into the node's learned timeouts (they only
        grow: a slow step seen once stays allowed); persists and logs a change."""
        a = self._auto
        now = time.monotonic()
        with self._lock:
            warm = [
                r for r in self._rhythms.values() if r.warm(a.warmup_steps, a.warmup_seconds, now)
            ]
        if warm and self._fold_learned(auto.from_rhythms(warm, a), "observed"):
            self._sync_wake.set()  # the other nodes hear of it without waiting a poll

    def _fold_learned(self, values: LearnedTimeouts, source: str) -> bool:
        """Takes the maximum of the node's learned timeouts and `values`; on a change,
        keeps it in the run folder and logs `timeouts_learned`. True on a change.

        The scanner (observed values) and the job's sync thread (other nodes' values)
        both come here; the file is written by one at a time, always the latest."""
        with self._learned_lock:
            with self._lock:
                merged = auto.merge(self._learned, values)
                if merged == self._learned:
                    return False
                self._learned = merged
            self._write_learned(merged)
            self._emit(Event.TIMEOUTS_LEARNED, {"source": source, **merged.to_state()})
        return True

    def _read_learned(self) -> None:
        path = self._learned_path
        if path is None:
            return
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_LEARNED_BYTES + 1)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("could not read learned timeouts %s: %s", path, exc)
            return
        try:
            learned = jobsync.decode_learned(raw)
        except ValueError as exc:
            log.warning("ignoring learned timeouts in %s: %s", path, exc)
            return
        self._fold_learned(learned, str(path))

    def _write_learned(self, learned: LearnedTimeouts) -> None:
        path = self._learned_path
        if path is None:
            return
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(learned.to_state(), sort_keys=True))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not keep learned timeouts in %s: %s", path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _note_bad_fields(self, rank: _Rank, pid: int, fields: list[str]) -> None:
        new = [f for f in fields if (rank.local_rank, f) not in self._bad_fields]
        if not new:
            return
        self._bad_fields.update((rank.local_rank, f) for f in new)
        log.warning(
            "rank %d (pid %d) slot holds out-of-range %s; ignored",
            rank.local_rank,
            pid,
            ", ".join(new),
        )
        self._emit(
            Event.MONITOR_BAD_SLOT, {"local_rank": rank.local_rank, "pid": pid, "fields": new}
        )

    def _begin_hang(
        self,
        rank: _Rank,
        target: int,
        verdict: Verdict,
        term_signal: int,
        waiting_on: int | None = None,
        stalled: Stalled | None = None,
    ) -> None:
        with self._lock:
            if not rank.judged:
                return
            rank.judged = False
            if stalled is not None:
                self._stalled.append(stalled)
        hang = _Hang(rank, target, verdict, term_signal or signal.SIGKILL, None, time.time())
        hang.attempt = self._attempt
        hang.waiting_on = waiting_on
        with self._lock:
            self._roots.setdefault(rank.global_rank, hang)
        log.warning(
            "rank %d (pid %d) hung: %s timeout %.3f s (section %s)%s",
            rank.local_rank,
            target,
            verdict.kind.value,
            verdict.timeout,
            verdict.section,
            "" if waiting_on is None else f"; most likely waiting on rank {waiting_on}",
        )
        step, wait = "terminate", 0.0
        self._open_dossier(rank, target, verdict, waiting_on)
        if self.config.stack_dump_wait > 0 and procs.catches_signal(target, signal.SIGUSR1):
            if rank.stderr is not None:
                try:
                    hang.stderr_offset = rank.stderr.stat().st_size
                except OSError:
                    hang.stderr_offset = None
            if procs.signal_pid(target, signal.SIGUSR1):
                # A stopped process only runs its handler once continued.
                procs.continue_if_stopped(target)
                hang.dump_sent_at = time.monotonic()
                self._mark_dossier_signalled(rank.local_rank)
                if hang.stderr_offset is None:
                    wait = self.config.stack_dump_wait
                else:
                    step, wait = "await_stacks", STACKS_POLL
        self._plan(time.monotonic() + wait, step, hang)

    def _await_stacks(self, hang: _Hang) -> None:
        """Terminates once the dump is written, polling the rank's stderr file.

        On a loaded node the rank may need longer than `stack_dump_wait` to be scheduled
        and write; waiting for the file to grow and settle captures the stacks there and
        saves time everywhere else. Bounded by STACKS_MAX_WAIT_FACTOR x stack_dump_wait.
        """
        assert hang.rank.stderr is not None and hang.stderr_offset is not None
        try:
            size = hang.rank.stderr.stat().st_size
        except OSError:
            size = hang.stderr_offset
        elapsed = time.monotonic() - hang.dump_sent_at
        written_and_settled = size > hang.stderr_offset and size == hang.last_size
        if written_and_settled or elapsed >= STACKS_MAX_WAIT_FACTOR * self.config.stack_dump_wait:
            self._terminate(hang)
            return
        hang.last_size = size
        self._plan(time.monotonic() + STACKS_POLL, "await_stacks", hang)

    def _plan(self, due: float, step: str, hang: _Hang) -> None:
        with self._lock:
            heapq.heappush(self._schedule, (due, next(self._seq), step, hang))
        self._wake.set()

    def _run_due(self, force: bool = False) -> None:
        while True:
            with self._lock:
                if not self._schedule or (not force and self._schedule[0][0] > time.monotonic()):
                    return
                _, _, step, hang = heapq.heappop(self._schedule)
            if step == "terminate" or (step == "await_stacks" and force):
                self._terminate(hang, escalate=not force)
            elif step == "await_stacks":
                self._await_stacks(hang)
            elif step == "kill":
                self._kill(hang)

    def _targets(self, hang: _Hang) -> list[int]:
        targets = [hang.target]
        if hang.rank.pid != hang.target:
            targets.append(hang.rank.pid)
        return [p for p in targets if self._same_process(hang.rank, p)]

    def _terminate(self, hang: _Hang, escalate: bool = True) -> None:
        with self._lock:
            if hang.terminated:
                return
            root = self._roots.get(hang.waiting_on) if hang.waiting_on is not None else None
        if escalate and root is not None and root is not hang and self._defer_for(hang, root):
            # The rank waited on exits first, so that the supervisor's first failure (its
            # root cause) is that rank; bounded by the root's own stack wait and kill.
            self._plan(time.monotonic() + STACKS_POLL, "terminate", hang)
            return
        with self._lock:
            if hang.terminated:
                return
            hang.terminated = True
        # Before any signal that kills: the dossier, then the report that points at it.
        hang.dossier = self._write_dossier(hang)
        # Queued before the signal: when the supervisor sees the worker exit, the reason
        # is already waiting in poll_hangs().
        report = self._report(hang)
        with self._lock:
            self._hangs.append(report)
        fields = report.to_event()
        fields["attempt"] = hang.attempt
        fields["stacks"] = report.stacks[-16384:]
        self._emit(Event.HANG_DETECTED, fields)
        for pid in self._targets(hang):
            procs.signal_pid(pid, hang.term_signal, group=True)
            procs.continue_if_stopped(pid, group=True)
        if escalate:
            self._plan(time.monotonic() + self.config.term_grace, "kill", hang)
        else:
            self._kill(hang)

    def _defer_for(self, hang: _Hang, root: _Hang) -> bool:
        now = time.monotonic()
        if hang.deferred_since is None:
            hang.deferred_since = now
        if now - hang.deferred_since > self.config.term_grace + 1.0:
            return False
        return not root.terminated or bool(self._targets(root))

    def _kill(self, hang: _Hang) -> None:
        for pid in self._targets(hang):
            if procs.is_alive(pid):
                log.warning("pid %d outlived the terminate signal; sending SIGKILL", pid)
                procs.signal_pid(pid, signal.SIGKILL, group=True)

    def _report(self, hang: _Hang) -> HangReport:
        stacks = ""
        path = hang.rank.stderr
        if path is not None and hang.stderr_offset is not None:
            try:
                with open(path, "rb") as f:
                    f.seek(hang.stderr_offset)
                    stacks = f.read(STACKS_MAX_BYTES).decode("utf-8", "replace")
            except OSError as exc:
                log.info("could not read stacks from %s: %s", path, exc)
        v = hang.verdict
        return HangReport(
            local_rank=hang.rank.local_rank,
            global_rank=hang.rank.global_rank,
            pid=hang.target,
            kind=v.kind,
            section=v.section,
            timeout=v.timeout,
            last_heartbeat_age=v.last_heartbeat_age,
            iteration=v.iteration,
            stacks=stacks,
            detected_at=hang.detected_at,
            waiting_on=hang.waiting_on,
            dossier=str(hang.dossier) if hang.dossier is not None else None,
        )

    # -- hang dossier ----------------------------------------------------------------
    def _open_dossier(
        self, hung: _Rank, target: int, verdict: Verdict, waiting_on: int | None
    ) -> None:
        """At the attempt's first hang: notes every rank's state and stderr size, then
        asks the others for their stacks and every rank's flight recorder for a dump.
        Later hangs only add their verdict."""
        if self._state_dir is None:
            return
        text = f"{verdict.kind.value} timeout {verdict.timeout:g}s" + (
            f", most likely waiting on rank {waiting_on}" if waiting_on is not None else ""
        )
        with self._lock:
            entries = self._dossier
            first = entries is None
            if entries is None:
                entries = self._dossier = {}
            ranks = list(self._ranks.values()) if first else []
        mm = self._mm
        now = time.monotonic()
        for rank in ranks:
            state = "unknown (no segment)"
            pid = rank.pid
            if mm is not None:
                snap = layout.read_slot(mm, rank.local_rank)
                names = layout.read_names(mm, rank.local_rank, snap.name_count)
                state = dossier.describe(snap, names, now, self._floor)
                if snap.pid > 0 and (snap.pid == rank.pid or snap.pid in rank.verified_pids):
                    pid = snap.pid
            offset = None
            if rank.stderr is not None:
                with contextlib.suppress(OSError):
                    offset = rank.stderr.stat().st_size
            entries[rank.local_rank] = dossier.RankEntry(
                rank.local_rank, rank.global_rank, pid, state, None, rank.stderr, offset
            )
        entry = entries.get(hung.local_rank)
        if entry is not None:
            entry.verdict = text
            entry.pid = target
        if not first:
            return
        for rank in ranks:
            e = entries[rank.local_rank]
            pipe = dossier.flight_recorder_pipe(os.environ, rank.global_rank)
            if pipe is not None and dossier.request_flight_recorder_dump(pipe):
                e.flight_recorder = pipe
            if rank.local_rank == hung.local_rank:
                continue  # _begin_hang asks the hung rank itself
            if (
                self.config.stack_dump_wait > 0
                and procs.is_alive(e.pid)
                and procs.catches_signal(e.pid, signal.SIGUSR1)
                and procs.signal_pid(e.pid, signal.SIGUSR1)
            ):
                procs.continue_if_stopped(e.pid)
                e.stacks_signalled = True

    def _mark_dossier_signalled(self, local_rank: int) -> None:
        with self._lock:
            entry = (self._dossier or {}).get(local_rank)
            if entry is not None:
                entry.stacks_signalled = True

    def _write_dossier(self, hang: _Hang) -> Path | None:
        """(Re)writes the attempt's dossier; its path, or None when there is none."""
        with self._lock:
            entries = list((self._dossier or {}).values())
        if self._state_dir is None or not entries:
            return None
        path = self._state_dir / dossier.dossier_name(hang.attempt)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(dossier.render(hang.attempt, entries, STACKS_MAX_BYTES))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not write the hang dossier %s: %s", path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return None
        return path

    # -- timer server thread ---------------------------------------------------------
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
