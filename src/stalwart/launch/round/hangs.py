"""The supervisor's side of hang detection: runs the node's monitor and turns what it
reports into the launcher's terms (failure reasons and stacks, stop requests).

The monitor reaps a hung worker itself; the supervisor then sees an ordinary worker
death, and ``explain`` attaches the hang that caused it so the summary says why.  The
supervisor never waits for a report before stopping the other workers: the monitor files
its report before it signals, and one that comes later (a rank judged hung that died on
its own meanwhile) is attached by calling ``explain`` again once the attempt is torn down.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from stalwart.base import envvars
from stalwart.base.events import Event
from stalwart.monitor import (
    ControlAction,
    ControlRequest,
    HangReport,
    MonitorConfig,
    NodeMonitor,
)
from stalwart.monitor import envvars as monitor_env
from stalwart.monitor.jobsync import JobPeers
from stalwart.rendezvous.api import WorkerFailed

logger = logging.getLogger(__name__)


class HangWatch:
    """One per launcher: the node monitor plus the hang reports of the current attempt."""

    def __init__(
        self,
        run_id: str,
        config: MonitorConfig,
        nproc: int,
        emit: Callable[..., Any],
        on_folder: Callable[[Path], Any] | None = None,
        state_dir: Path | None = None,
    ) -> None:
        self.config = config
        self._emit = emit
        # Pipe and shared memory live in a private local folder (0700), never in the log
        # folder, which may be a shared filesystem where named pipes do not work.
        self.ipc = Path(tempfile.mkdtemp(prefix=f"stalwart-{run_id}-"))
        ipc = self.ipc
        if on_folder is not None:
            on_folder(ipc)

        def log_event(event: Event, fields: dict[str, Any]) -> None:
            emit(event, **fields)

        self.monitor = NodeMonitor(ipc, config, nproc, log_event, state_dir=state_dir)
        self.monitor.start()
        self._hangs: dict[int, HangReport] = {}  # pid -> report, this attempt

    def worker_env(self, local_rank: int, rank: int) -> dict[str, str]:
        env = self.monitor.worker_env(local_rank, rank)
        # torchrun names its timer pipe only when file timers are enabled; do the same so
        # a worker's environment matches torchrun's (ours has its own variable).
        if os.environ.get(envvars.ENABLE_FILE_TIMER) != "1":
            env.pop(monitor_env.TORCHELASTIC_TIMER_FILE, None)
        env[envvars.AUTO_PROGRESS] = "1" if self.config.auto_progress else "0"
        return env

    def begin(
        self,
        attempt: int,
        pids: dict[int, int],
        stderr: dict[int, Path],
        ranks: dict[int, int],
        peers: JobPeers | None = None,
    ) -> None:
        """peers: the round's other nodes, shared with through the job's store
        (``monitor_sync.job_peers``)."""
        self._hangs = {}
        self.monitor.join_job(peers)
        self.monitor.begin_attempt(attempt, pids, stderr_paths=stderr, global_ranks=ranks)

    def end(self) -> None:
        """Workers are being stopped: no more judging (no false hang during teardown)."""
        self.monitor.end_attempt()

    def collect(self) -> None:
        for report in self.monitor.poll_hangs():
            self._hangs[report.pid] = report

    def explain(self, failures: dict[int, WorkerFailed]) -> bool:
        """Gives failures of workers the monitor judged hung the hang as reason; its stacks
        stand in for a traceback (the records in *failures* are replaced).  Uses the
        reports filed so far and never waits for one, so a death is acted on at once;
        returns True when it changed a failure (call it again after the teardown for
        reports that came late)."""
        self.collect()
        changed = False
        for key, f in failures.items():
            hang = self._hangs.get(f.pid)
            if hang is None:
                continue
            reason, timestamp, traceback = annotate(f, hang)
            if (reason, timestamp, traceback) != (f.reason, f.timestamp, f.traceback):
                failures[key] = msgspec.structs.replace(
                    f, reason=reason, timestamp=timestamp, traceback=traceback
                )
                changed = True
        changed |= _blame_first(failures, self._hangs)
        return changed

    def count_hung_roots(self, failures: dict[int, WorkerFailed], node_rank: int) -> bool:
        """Adds to *failures* (local rank -> failure) each rank the monitor found hung as a
        root cause (no peer it waited on) that is not among them: a framework that
        catches the terminate signal (Lightning) may exit 0 from a rank that was stopped,
        and the verdict made at detection, not that exit code, is the one reported.
        True when it added one."""
        self.collect()
        pids = {f.pid for f in failures.values()}
        added = False
        for report in self._hangs.values():
            if report.waiting_on is not None or report.pid in pids:
                continue
            if report.local_rank in failures:
                continue
            exited = WorkerFailed(
                node_rank=node_rank,
                local_rank=report.local_rank,
                pid=report.pid,
                exitcode=0,
                rank=report.global_rank,
            )
            reason, timestamp, traceback = annotate(exited, report)
            failures[report.local_rank] = msgspec.structs.replace(
                exited, reason=reason, timestamp=timestamp, traceback=traceback
            )
            added = True
        return added

    def control_request(self, attempt: int) -> ControlRequest | None:
        """The rank's request that ends this round, if any: a request to shut the
        workload down wins over one to exclude a node; "continue" ends nothing."""
        chosen: ControlRequest | None = None
        for req in self.monitor.poll_requests():
            self._emit(
                Event.CONTROL_REQUEST,
                attempt=attempt,
                action=req.action.value,
                rank=req.global_rank,
                worker_pid=req.pid,
                **({"reason": req.reason} if req.reason else {}),
            )
            if req.action is ControlAction.SHUTDOWN_WORKLOAD:
                if chosen is None or chosen.action is not ControlAction.SHUTDOWN_WORKLOAD:
                    chosen = req
            elif req.action is ControlAction.EXCLUDE_NODE and chosen is None:
                chosen = req
        return chosen

    def stop(self) -> None:
        self.monitor.stop()
        shutil.rmtree(self.ipc, ignore_errors=True)


def annotate(failure: WorkerFailed, hang: HangReport) -> tuple[str, float, str]:
    """(reason, timestamp, traceback) of *failure* once *hang* explains it: the hang is
    the reason, its detection time the failure's time (it came first), its stacks the
    traceback when the worker left none."""
    bits = [f"hang detected: {hang.kind.value} timeout {hang.timeout:g}s"]
    if hang.section:
        bits.append(f"section {hang.section!r}")
    if hang.last_heartbeat_age is not None:
        bits.append(f"last heartbeat {hang.last_heartbeat_age:.1f}s ago")
    if hang.iteration is not None:
        bits.append(f"iteration {hang.iteration}")
    if hang.waiting_on is not None:
        bits.append(f"most likely waiting on rank {hang.waiting_on}")
    if hang.evidence:
        bits.append(hang.evidence)
    if hang.dossier:
        bits.append(f"dossier {hang.dossier}")
    traceback = failure.traceback
    if hang.stacks and not traceback:
        traceback = hang.stacks
    return ", ".join(bits), min(failure.timestamp, hang.detected_at), traceback


def _blame_first(failures: dict[int, WorkerFailed], hangs: dict[int, HangReport]) -> bool:
    """Makes the rank a hung peer waited on the earliest failure, so that ``root_cause``
    (the earliest) names it, however the exits happened to be ordered."""
    key_of = {f.rank: key for key, f in failures.items()}
    moved = False
    for key in list(failures):
        f = failures[key]
        hang = hangs.get(f.pid)
        if hang is None or hang.waiting_on is None:
            continue
        root_key = key_of.get(hang.waiting_on)
        if root_key is None or root_key == key:
            continue
        root = failures[root_key]
        if root.timestamp >= f.timestamp:
            failures[root_key] = msgspec.structs.replace(root, timestamp=f.timestamp - 1e-6)
            moved = True
    return moved
