"""`NodeMonitor`: the launcher-side owner of one node's hang detection.

It creates the per-run folder (0700), the shared-memory segment and the timer pipe
(0600), and runs two threads: the timer server and a scanner that judges every armed
rank's slot each `check_interval`. A hung rank is asked for its stacks (a real-time
signal, with SIGCONT in case it is stopped), then sent the terminate signal, then SIGKILL after the
grace period; a `HangReport` is queued for the supervisor and a `hang_detected` event
logged. Never imports the launcher: the supervisor drives it through the methods below.

This module holds the supervisor's calls and the scanner loop; each other concern is a
part of its own, put together here: `node_state` (fields, records), `node_hangs`,
`node_requests` (timer pipe), `node_learned` (auto timeouts), `node_stragglers`,
`node_sync` (the job's store).
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from stalwart.base import procs
from stalwart.base.events import Event
from stalwart.monitor import auto, envvars, layout
from stalwart.monitor.evidence import Reading, Role
from stalwart.monitor.jobsync import JobPeers
from stalwart.monitor.judge import (
    BLAME_RESOLUTION,
    Stalled,
    Verdict,
    blame,
    judge,
    next_deadline,
    problems,
)
from stalwart.monitor.node_requests import NodeRequests
from stalwart.monitor.node_state import SHM_NAME, _ensure_private_dir, _Rank
from stalwart.monitor.node_sync import NodeSync
from stalwart.monitor.reports import ControlRequest, HangReport
from stalwart.monitor.suspicions import Watched

log = logging.getLogger(__name__)

#: The scanner looks this soon after a rank's deadline (a timestamp written a moment
#: late must not make it look twice), and never more often than every DEADLINE_MIN_WAIT.
#: Ranks whose deadlines are within BLAME_RESOLUTION are then found hung in one scan, so
#: `blame` compares them all (found alone, the first one would be the root cause).
DEADLINE_SLACK = 0.002 + BLAME_RESOLUTION
DEADLINE_MIN_WAIT = 0.005
#: A rank is named a straggler on the console at most this often (seconds).


def _waiting(reading: Reading | None) -> bool | None:
    if reading is None or reading.role is Role.UNKNOWN:
        return None
    return reading.role is Role.WAITING


class NodeMonitor(NodeRequests, NodeSync):
    """One per node. See docs/monitor.md for the supervisor contract."""

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
            self._suspicions.reset()
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
            self._suspicions.reset()
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
        readings: dict[int, Reading] = {}
        if self.config.needs_evidence:
            # A missed deadline is a suspicion; only evidence makes it a hang.
            with self._lock:
                watched = {lr: Watched(r.pid, r.stderr) for lr, r in self._ranks.items()}
            past = {lr: writer for lr, (_, writer, _) in found.items()}
            readings = self._suspicions.confirm(past, watched, time.monotonic())
            found = {lr: found[lr] for lr in readings}
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
