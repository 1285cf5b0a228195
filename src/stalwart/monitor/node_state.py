"""What the parts of a node monitor share: its fields, the records they pass, two helpers.

`NodeState` sets up every field of `NodeMonitor` (locks, the attempt's ranks, the hang
schedule, learned timeouts, the job-sync round, the timer server) and owns emitting an
event and telling whether a pid is one of this attempt's workers. The parts built on it
(`node_learned`, `node_stragglers`, `node_sync`, `node_hangs`, `node_requests`) add the
methods of one concern each; `node.NodeMonitor` puts them together.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stalwart.base import procs
from stalwart.base.events import Event
from stalwart.base.files import untrusted
from stalwart.monitor import auto, dossier, jobsync, stacks
from stalwart.monitor.config import MonitorConfig
from stalwart.monitor.jobsync import JobPeers, NodeRhythm
from stalwart.monitor.judge import (
    Stalled,
    Verdict,
)
from stalwart.monitor.learned import LearnedTimeouts
from stalwart.monitor.reports import ControlRequest, HangReport
from stalwart.monitor.suspicions import Suspicions
from stalwart.monitor.timer_server import ExpiredTimer, TimerServer
from stalwart.monitor.wire import ControlMessage

log = logging.getLogger(__name__)

LogEvent = Callable[[Event, dict[str, Any]], None]

SHM_NAME = "monitor.shm"
PIPE_NAME = "timer.pipe"
#: Refused pids remembered so that each is logged once (then the set starts afresh).
MAX_REFUSED_LOGGED = 4096
LEARNED_NAME = "learned_timeouts.json"


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
    stderr_end: int | None = None  # where its dump ended, once settled
    last_size: int = -1
    terminated: bool = False
    waiting_on: int | None = None
    dossier: Path | None = None
    deferred_since: float | None = None  # monotonic: waiting for the rank it waited on
    evidence: str | None = None  # what its processes and stack showed (evidence mode)


def _ask_stacks(pid: int) -> bool:
    """Asks a rank for its stacks, only where it has the handler (else the signal kills)."""
    return procs.catches_signal(pid, stacks.STACK_SIGNAL) and procs.signal_pid(
        pid, stacks.STACK_SIGNAL
    )


def _ensure_private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    problem = untrusted(os.lstat(path), "folder", private=False)
    if problem is not None:
        raise PermissionError(f"monitor folder {path}: {problem}")
    os.chmod(path, 0o700)


class NodeState(abc.ABC):
    """The fields every part of `NodeMonitor` reads and writes."""

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
        # Ranks past a learned deadline, until evidence says they are hung (or not).
        self._suspicions = Suspicions(_ask_stacks)
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

    @abc.abstractmethod
    def _on_timer_expired(self, timer: ExpiredTimer) -> None:
        """The timer server's callback for an expired timer (see node_requests)."""

    @abc.abstractmethod
    def _on_control(self, msg: ControlMessage) -> None:
        """The timer server's callback for a worker's control request (see node_requests)."""

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
