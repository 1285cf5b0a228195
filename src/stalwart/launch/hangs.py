"""The supervisor's side of hang detection: runs the node's monitor and turns what it
reports into the launcher's terms (failure reasons and stacks, stop requests).

The monitor reaps a hung worker itself; the supervisor then sees an ordinary worker
death, and ``explain`` attaches the hang that caused it so the summary says why.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stalwart.launch.errors import ProcessFailure
from stalwart.monitor import ControlAction, HangReport, MonitorConfig, NodeMonitor

logger = logging.getLogger(__name__)

# How long to wait for the monitor's report after a worker it terminated has exited: the
# report is filed microseconds after the signal, so this only bounds a pathological case.
_REPORT_WAIT = 1.0


class HangWatch:
    """One per launcher: the node monitor plus the hang reports of the current attempt."""

    def __init__(
        self,
        run_id: str,
        config: MonitorConfig,
        nproc: int,
        emit: Callable[..., Any],
        state_dir: Path | None = None,
    ) -> None:
        self.config = config
        self._emit = emit
        # Pipe and shared memory live in a private local folder (0700), never in the log
        # folder, which may be a shared filesystem where named pipes do not work.
        self.ipc = Path(tempfile.mkdtemp(prefix=f"stalwart-{run_id}-"))
        ipc = self.ipc

        def log_event(event: str, fields: dict[str, Any]) -> None:
            emit(event, **fields)

        self.monitor = NodeMonitor(ipc, config, nproc, log_event, state_dir=state_dir)
        self.monitor.start()
        self._hangs: dict[int, HangReport] = {}  # pid -> report, this attempt

    def worker_env(self, local_rank: int, rank: int) -> dict[str, str]:
        env = self.monitor.worker_env(local_rank, rank)
        # torchrun names its timer pipe only when file timers are enabled; do the same so
        # a worker's environment matches torchrun's (ours has its own variable).
        if os.environ.get("TORCHELASTIC_ENABLE_FILE_TIMER") != "1":
            env.pop("TORCHELASTIC_TIMER_FILE", None)
        return env

    def begin(
        self, attempt: int, pids: dict[int, int], stderr: dict[int, Path], ranks: dict[int, int]
    ) -> None:
        self._hangs = {}
        self.monitor.begin_attempt(attempt, pids, stderr_paths=stderr, global_ranks=ranks)

    def end(self) -> None:
        """Workers are being stopped: no more judging (no false hang during teardown)."""
        self.monitor.end_attempt()

    def collect(self) -> None:
        for report in self.monitor.poll_hangs():
            self._hangs[report.pid] = report

    def explain(self, failures: list[ProcessFailure]) -> None:
        """Gives failures of workers the monitor terminated the hang as reason; its stacks
        stand in for a traceback."""
        self.collect()
        deadline = time.monotonic() + _REPORT_WAIT
        pending = [f for f in failures if f.pid not in self._hangs]
        while pending and self._killed_by_monitor(pending) and time.monotonic() < deadline:
            time.sleep(0.01)
            self.collect()
            pending = [f for f in pending if f.pid not in self._hangs]
        for f in failures:
            hang = self._hangs.get(f.pid)
            if hang is None:
                continue
            bits = [f"hang detected: {hang.kind.value} timeout {hang.timeout:g}s"]
            if hang.section:
                bits.append(f"section {hang.section!r}")
            if hang.last_heartbeat_age is not None:
                bits.append(f"last heartbeat {hang.last_heartbeat_age:.1f}s ago")
            if hang.iteration is not None:
                bits.append(f"iteration {hang.iteration}")
            if hang.waiting_on is not None:
                bits.append(f"most likely waiting on rank {hang.waiting_on}")
            if hang.dossier:
                bits.append(f"dossier {hang.dossier}")
            f.reason = ", ".join(bits)
            f.timestamp = min(f.timestamp, hang.detected_at)
            if hang.stacks and not f.traceback:
                f.traceback = hang.stacks
        _blame_first(failures, self._hangs)

    def _killed_by_monitor(self, failures: list[ProcessFailure]) -> bool:
        sig = int(self.config.term_signal)
        return any(f.exitcode in (-sig, -int(signal.SIGKILL)) for f in failures)

    def stop_requested(self, attempt: int) -> bool:
        """True when a rank asked to shut the workload down (or to exclude this node,
        which with static membership ends the job the same way)."""
        stop = False
        for req in self.monitor.poll_requests():
            self._emit(
                "control_request",
                attempt=attempt,
                action=req.action.value,
                rank=req.global_rank,
                worker_pid=req.pid,
            )
            if req.action in (ControlAction.SHUTDOWN_WORKLOAD, ControlAction.EXCLUDE_NODE):
                logger.error(
                    "rank %s asked to %s: stopping the job without restart",
                    req.global_rank,
                    req.action.value.replace("_", " "),
                )
                stop = True
        return stop

    def stop(self) -> None:
        self.monitor.stop()
        shutil.rmtree(self.ipc, ignore_errors=True)


def _blame_first(failures: list[ProcessFailure], hangs: dict[int, HangReport]) -> None:
    """Makes the rank a hung peer waited on the earliest failure, so that ``root_cause``
    (the earliest) names it, however the exits happened to be ordered."""
    by_rank = {f.rank: f for f in failures}
    for f in failures:
        hang = hangs.get(f.pid)
        if hang is None or hang.waiting_on is None:
            continue
        root = by_rank.get(hang.waiting_on)
        if root is not None and root is not f and root.timestamp >= f.timestamp:
            root.timestamp = f.timestamp - 1e-6
