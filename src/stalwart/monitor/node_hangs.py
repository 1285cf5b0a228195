"""Handling a hang: stacks, the dossier, terminate, kill, the report.

`HangHandler` owns every hang of the attempt. A hung rank is asked for its stacks
(`stacks.STACK_SIGNAL`, with SIGCONT in case it is stopped); the scanner thread runs the
planned steps in due order (`run_due`): wait for the dump to settle, write the attempt's
hang dossier, queue the `HangReport`, send the terminate signal, then SIGKILL after the
grace period. A rank found waiting on another one's hang is terminated after it, so that
the supervisor's first failure is the root cause.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from stalwart.base import procs
from stalwart.base.events import Event
from stalwart.base.files import replace_file
from stalwart.monitor import dossier, layout, stacks
from stalwart.monitor.config import MonitorConfig
from stalwart.monitor.judge import Stalled, Verdict, blame
from stalwart.monitor.node_slots import Slots
from stalwart.monitor.node_state import AttemptRanks, Hang, LogEvent, Rank, same_process
from stalwart.monitor.reports import HangReport

log = logging.getLogger(__name__)

STACKS_MAX_BYTES = 64 * 1024
STACKS_POLL = 0.02
STACKS_MAX_WAIT_FACTOR = 5


class HangHandler:
    """The hangs of a node monitor, from the verdict to the report and the kill."""

    def __init__(
        self,
        config: MonitorConfig,
        ranks: AttemptRanks,
        slots: Slots,
        emit: LogEvent,
        state_dir: Path | None,
        wake: Callable[[], None],
    ) -> None:
        """state_dir: where hang dossiers are written (None: none is); wake: tells the
        scanner a step was planned (it sleeps until the earliest one)."""
        self.config = config
        self._ranks = ranks
        self._slots = slots
        self._emit = emit
        self._state_dir = state_dir
        self._wake = wake
        self._lock = threading.RLock()
        # Ranks found hung this attempt, so that one found later is compared with them.
        self._stalled: list[Stalled] = []
        self._roots: dict[int, Hang] = {}  # global rank -> its hang, this attempt
        self._hangs: list[HangReport] = []
        # (due, seq, step, hang): steps run on the scanner thread, in due order.
        self._schedule: list[tuple[float, int, str, Hang]] = []
        self._seq = itertools.count()
        # The hang dossier of the current attempt: every rank's state and stack offsets.
        self._dossier: dict[int, dossier.RankEntry] | None = None

    # -- what the coordinator calls -------------------------------------------------
    def new_attempt(self) -> None:
        with self._lock:
            self._stalled = []
            self._roots = {}
            self._dossier = None

    def end_attempt(self) -> None:
        """Terminates every hang still waiting for its stacks (in the order found), so
        the supervisor's next poll sees every hang of the attempt it is ending."""
        with self._lock:
            self._stalled = []
            self._roots = {}  # pending hangs below are terminated now, in no order
            # The pending hangs below still write the dossier of the attempt they belong to.
            pending = [item for item in self._schedule if item[2] != "kill"]
            self._schedule = [item for item in self._schedule if item[2] == "kill"]
            heapq.heapify(self._schedule)
        for _, _, _, hang in sorted(pending, key=lambda item: item[:2]):
            self._terminate(hang)

    def blame(self, fresh: list[Stalled]) -> list[Stalled]:
        """`fresh` and the attempt's earlier hung ranks, root cause first."""
        with self._lock:
            return blame(self._stalled + fresh)

    def next_due(self) -> float | None:
        """Monotonic time of the earliest planned step; None when none is planned."""
        with self._lock:
            return self._schedule[0][0] if self._schedule else None

    def poll(self) -> list[HangReport]:
        with self._lock:
            out, self._hangs = self._hangs, []
        return out

    def begin(
        self,
        rank: Rank,
        target: int,
        verdict: Verdict,
        term_signal: int,
        waiting_on: int | None = None,
        stalled: Stalled | None = None,
    ) -> None:
        if not self._ranks.claim(rank):
            return
        with self._lock:
            if stalled is not None:
                self._stalled.append(stalled)
        hang = Hang(rank, target, verdict, term_signal or signal.SIGKILL, None, time.time())
        hang.attempt = self._ranks.attempt
        hang.waiting_on = waiting_on
        hang.evidence = stalled.why if stalled is not None else None
        with self._lock:
            self._roots.setdefault(rank.global_rank, hang)
        log.warning(
            "rank %d (pid %d) hung: %s timeout %.3f s (section %s)%s%s",
            rank.local_rank,
            target,
            verdict.kind.value,
            verdict.timeout,
            verdict.section,
            "" if waiting_on is None else f"; most likely waiting on rank {waiting_on}",
            "" if hang.evidence is None else f" ({hang.evidence})",
        )
        step, wait = "terminate", 0.0
        stopped = self._open_dossier(rank, target, verdict, waiting_on, hang.evidence)
        asked = self._asked_at_detection(rank)
        if asked is not None:
            # The dossier asked this rank for its stacks when the attempt's first hang was
            # found. A second dump now could show it past the hang (a stopped peer, once
            # continued for its own dump, lets the collective finish): report that one.
            hang.stderr_offset = asked
            hang.dump_sent_at = time.monotonic()
            step, wait = "await_stacks", STACKS_POLL
        elif self.config.stack_dump_wait > 0 and procs.catches_signal(target, stacks.STACK_SIGNAL):
            if rank.stderr is not None:
                try:
                    hang.stderr_offset = rank.stderr.stat().st_size
                except OSError:
                    hang.stderr_offset = None
            if procs.signal_pid(target, stacks.STACK_SIGNAL):
                # A stopped process only runs its handler once continued.
                procs.continue_if_stopped(target)
                hang.dump_sent_at = time.monotonic()
                self._mark_dossier_signalled(rank.local_rank)
                if hang.stderr_offset is None:
                    wait = self.config.stack_dump_wait
                else:
                    step, wait = "await_stacks", STACKS_POLL
        # Only now, with every rank asked: a stopped rank continued earlier could let
        # its waiting peers run on before they dumped where they waited.
        for pid in stopped:
            procs.continue_if_stopped(pid)
        self._plan(time.monotonic() + wait, step, hang)

    def _asked_at_detection(self, rank: Rank) -> int | None:
        """Where the dump the dossier asked of *rank* begins in its stacks file, when the
        dossier asked (as another rank's hang was found); else None."""
        with self._lock:
            entry = (self._dossier or {}).get(rank.local_rank)
        if entry is None or not entry.stacks_signalled or entry.stderr != rank.stderr:
            return None
        return entry.stderr_offset

    def _await_stacks(self, hang: Hang) -> None:
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
            if written_and_settled:
                hang.stderr_end = size  # a later dump is not this hang's
            self._terminate(hang)
            return
        hang.last_size = size
        self._plan(time.monotonic() + STACKS_POLL, "await_stacks", hang)

    def _plan(self, due: float, step: str, hang: Hang) -> None:
        with self._lock:
            heapq.heappush(self._schedule, (due, next(self._seq), step, hang))
        self._wake()

    def run_due(self, force: bool = False) -> None:
        """Runs the steps that are due (force: all of them, without waiting)."""
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

    def _targets(self, hang: Hang) -> list[int]:
        targets = [hang.target]
        if hang.rank.pid != hang.target:
            targets.append(hang.rank.pid)
        return [p for p in targets if same_process(hang.rank, p)]

    def _terminate(self, hang: Hang, escalate: bool = True) -> None:
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

    def _defer_for(self, hang: Hang, root: Hang) -> bool:
        now = time.monotonic()
        if hang.deferred_since is None:
            hang.deferred_since = now
        if now - hang.deferred_since > self.config.term_grace + 1.0:
            return False
        return not root.terminated or bool(self._targets(root))

    def _kill(self, hang: Hang) -> None:
        for pid in self._targets(hang):
            if procs.is_alive(pid):
                log.warning("pid %d outlived the terminate signal; sending SIGKILL", pid)
                procs.signal_pid(pid, signal.SIGKILL, group=True)

    def _report(self, hang: Hang) -> HangReport:
        stacks = ""
        path = hang.rank.stderr
        if path is not None and hang.stderr_offset is not None:
            try:
                with open(path, "rb") as f:
                    f.seek(hang.stderr_offset)
                    size = STACKS_MAX_BYTES
                    if hang.stderr_end is not None:
                        size = min(size, hang.stderr_end - hang.stderr_offset)
                    stacks = f.read(size).decode("utf-8", "replace")
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
            evidence=hang.evidence,
        )

    # -- hang dossier ----------------------------------------------------------------
    def _open_dossier(
        self,
        hung: Rank,
        target: int,
        verdict: Verdict,
        waiting_on: int | None,
        evidence: str | None = None,
    ) -> list[int]:
        """At the attempt's first hang: notes every rank's state and stderr size, then
        asks the others for their stacks and every rank's flight recorder for a dump.
        Later hangs only add their verdict. Returns the asked ranks that are stopped,
        for the caller to continue once the hung rank was asked too."""
        if self._state_dir is None:
            return []
        text = (
            f"{verdict.kind.value} timeout {verdict.timeout:g}s"
            + (f", most likely waiting on rank {waiting_on}" if waiting_on is not None else "")
            + (f"; {evidence}" if evidence else "")
        )
        with self._lock:
            entries = self._dossier
            first = entries is None
            if entries is None:
                entries = self._dossier = {}
            ranks = self._ranks.current() if first else []
        mm = self._slots.mapping
        now = time.monotonic()
        for rank in ranks:
            state = "unknown (no segment)"
            pid = rank.pid
            if mm is not None:
                snap = layout.read_slot(mm, rank.local_rank)
                names = layout.read_names(mm, rank.local_rank, snap.name_count)
                state = dossier.describe(snap, names, now, self._slots.floor)
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
            return []
        stopped: list[int] = []
        for rank in ranks:
            e = entries[rank.local_rank]
            pipe = dossier.flight_recorder_pipe(os.environ, rank.global_rank)
            if pipe is not None and dossier.request_flight_recorder_dump(pipe):
                e.flight_recorder = pipe
            if rank.local_rank == hung.local_rank:
                continue  # begin() asks the hung rank itself
            if (
                self.config.stack_dump_wait > 0
                and procs.is_alive(e.pid)
                and procs.catches_signal(e.pid, stacks.STACK_SIGNAL)
                and procs.signal_pid(e.pid, stacks.STACK_SIGNAL)
            ):
                stopped.append(e.pid)
                e.stacks_signalled = True
        return stopped

    def _mark_dossier_signalled(self, local_rank: int) -> None:
        with self._lock:
            entry = (self._dossier or {}).get(local_rank)
            if entry is not None:
                entry.stacks_signalled = True

    def _write_dossier(self, hang: Hang) -> Path | None:
        """(Re)writes the attempt's dossier; its path, or None when there is none."""
        with self._lock:
            entries = list((self._dossier or {}).values())
        if self._state_dir is None or not entries:
            return None
        path = self._state_dir / dossier.dossier_name(hang.attempt)
        try:
            replace_file(path, dossier.render(hang.attempt, entries, STACKS_MAX_BYTES).encode())
        except OSError as exc:
            log.warning("could not write the hang dossier %s: %s", path, exc)
            return None
        return path
