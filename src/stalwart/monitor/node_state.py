"""The node monitor's records and its two smallest parts: the event sink and the ranks.

`Rank`, `Window` and `Hang` are the records the parts hand each other. `EventSink` is
the one way a part logs an event (serialised, and never raising into a scanner).
`AttemptRanks` owns the attempt's ranks: which pid is which rank (or descends from one),
which ranks are still judged, the attempt number; it calls no other part.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stalwart.base import procs
from stalwart.base.events import Event
from stalwart.base.files import untrusted
from stalwart.monitor import stacks
from stalwart.monitor.jobsync import NodeRhythm
from stalwart.monitor.judge import Lookout, Verdict
from stalwart.monitor.suspicions import Watched

log = logging.getLogger(__name__)

LogEvent = Callable[[Event, dict[str, Any]], None]

SHM_NAME = "monitor.shm"
PIPE_NAME = "timer.pipe"
#: Refused pids remembered so that each is logged once (then the set starts afresh).
MAX_REFUSED_LOGGED = 4096
LEARNED_NAME = "learned_timeouts.json"


@dataclasses.dataclass
class Rank:
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
    # When the evidence cycle looks at it (evidence mode only), as of the last read.
    lookout: Lookout | None = None
    # (monotonic time, iteration) whenever the iteration moved: the straggler check's input
    progress: list[tuple[float, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Window:
    """A straggler window of this node, waiting to be compared with the job's."""

    rhythm: NodeRhythm
    local_ranks: dict[int, int]  # global -> local rank
    attempt: int | None


@dataclasses.dataclass
class Hang:
    """A hang being handled: stacks requested, then terminate, then kill."""

    rank: Rank
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


def ask_stacks(pid: int) -> bool:
    """Asks a rank for its stacks, only where it has the handler (else the signal kills)."""
    return procs.catches_signal(pid, stacks.STACK_SIGNAL) and procs.signal_pid(
        pid, stacks.STACK_SIGNAL
    )


def ensure_private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    problem = untrusted(os.lstat(path), "folder", private=False)
    if problem is not None:
        raise PermissionError(f"monitor folder {path}: {problem}")
    os.chmod(path, 0o700)


class EventSink:
    """Logs the monitor's events one at a time from any of its threads."""

    def __init__(self, log_event: LogEvent) -> None:
        self._log_event = log_event
        self._lock = threading.Lock()

    def __call__(self, event: Event, fields: dict[str, Any]) -> None:
        try:
            with self._lock:
                self._log_event(event, fields)
        except Exception:  # a broken sink must not stop hang detection
            log.exception("log_event(%s) failed", event)


class AttemptRanks:
    """The ranks of the attempt being judged, and which process belongs to which."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[int, Rank] = {}
        self._global_ranks: dict[int, int] = {}  # from worker_env, until the attempt says
        self._attempt: int | None = None
        # pid -> start time of processes found not to descend from a worker (this attempt).
        self._not_ours: dict[int, int] = {}

    @property
    def attempt(self) -> int | None:
        return self._attempt

    def name(self, local_rank: int, global_rank: int) -> None:
        with self._lock:
            self._global_ranks[local_rank] = global_rank

    def begin(
        self,
        attempt: int,
        pids: dict[int, int],
        stderr_paths: dict[int, Path],
        global_ranks: dict[int, int] | None,
    ) -> None:
        with self._lock:
            self._not_ours.clear()
            self._attempt = attempt
            self._ranks = {
                lr: Rank(
                    local_rank=lr,
                    global_rank=(global_ranks or self._global_ranks).get(lr, -1),
                    pid=pid,
                    start_time=procs.start_time(pid),
                    stderr=Path(stderr_paths[lr]) if lr in stderr_paths else None,
                )
                for lr, pid in pids.items()
            }

    def end(self) -> list[Rank]:
        """Forgets the attempt; the ranks it had."""
        with self._lock:
            ended = list(self._ranks.values())
            self._ranks = {}
            self._attempt = None
        return ended

    def current(self) -> list[Rank]:
        with self._lock:
            return list(self._ranks.values())

    def armed(self) -> list[Rank]:
        """The ranks still judged (no hang handled yet this attempt)."""
        with self._lock:
            return [r for r in self._ranks.values() if r.judged]

    def watched(self) -> dict[int, Watched]:
        with self._lock:
            return {
                lr: Watched(r.pid, r.stderr, r.lookout.since if r.lookout is not None else None)
                for lr, r in self._ranks.items()
            }

    def pid_of(self, local_rank: int) -> int:
        """The worker pid of `local_rank` this attempt; 0 when there is none."""
        with self._lock:
            rank = self._ranks.get(local_rank)
        return rank.pid if rank is not None else 0

    def claim(self, rank: Rank) -> bool:
        """True once per rank and attempt: the caller handles its hang."""
        with self._lock:
            if not rank.judged:
                return False
            rank.judged = False
            return True

    def owner_of(self, pid: int) -> Rank | None:
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


def same_process(rank: Rank, pid: int) -> bool:
    """Whether `pid` is still the process `rank` knew by it (not a reused pid)."""
    if pid != rank.pid:
        if pid in rank.verified_pids:
            return procs.start_time(pid) == rank.verified_pids[pid] and procs.is_alive(pid)
        return procs.is_alive(pid)
    return rank.start_time is None or procs.start_time(pid) == rank.start_time
