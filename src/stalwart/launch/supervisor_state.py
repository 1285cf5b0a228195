"""What the parts of a node's supervisor share: its fields and the records it returns.

`SupervisorState` sets up every field of `Supervisor` (the run folder, the event log,
the resources made for the job, the round under way); the parts built on it
(`supervisor_resources`, `supervisor_attempt`, `supervisor_ending`) add the methods of
one concern each, and `supervisor.Supervisor` puts them together around its loop.
"""

from __future__ import annotations

import os
import signal
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.config import ConfigError, LaunchConfig
from stalwart.config.secret import node_secret
from stalwart.health.guard import QuarantineGuard
from stalwart.launch.cgroup import JobCgroup
from stalwart.launch.decide import State
from stalwart.launch.events import EventLog, EventTail
from stalwart.launch.guardian import Guardian
from stalwart.launch.hangs import HangWatch
from stalwart.launch.logs import LogSpec
from stalwart.launch.replicas import NodeReplicas
from stalwart.launch.restart_policy import AttemptEnd
from stalwart.launch.runfiles import check_component, make_run_dir
from stalwart.launch.snapshots import SnapshotMemory
from stalwart.launch.warm import WarmPool
from stalwart.launch.workers import ProcessContext
from stalwart.progress import ProgressBoard, Sample
from stalwart.rendezvous import Rendezvous, WorkerFailed
from stalwart.reporting.metrics import MetricsPortError, MetricsServer


class SignalReceived(BaseException):
    """A termination signal reached the launcher; the job must stop now.

    A BaseException, as KeyboardInterrupt is: the handler raises it wherever the main
    thread happens to be, and an ``except Exception`` there (logging's ``emit``, a sink
    that must not stop hang detection) would otherwise swallow the signal and leave the
    job running (seen once under load: a SIGINT the launcher never acted on).
    """

    def __init__(self, sig: int) -> None:
        super().__init__(f"launcher received {signal.Signals(sig).name}")
        self.sig = sig


@dataclass(frozen=True)
class JobResult:
    """How the job ended on this node; made from a ``Stop`` in one place
    (``Supervisor._result``)."""

    exit_code: int
    state: State
    attempts: int
    failures: list[WorkerFailed]
    return_values: dict[int, Any]
    run_dir: Path | None


class SupervisorState:
    """The fields every part of `Supervisor` reads and writes."""

    def __init__(self, cfg: LaunchConfig, rendezvous: Rendezvous | None = None) -> None:
        self.cfg = cfg
        # Read once and kept in memory: the workers' environment goes without it.
        self._secret = node_secret(cfg.job_secret_file, os.environ, multi_node=cfg.max_nodes > 1)
        self._worker_key_env: dict[str, str] = {}  # where workers find their records' key
        # First: a taken port is a one-line error before anything is created.
        try:
            self._metrics = (
                MetricsServer(cfg.metrics_port, cfg.metrics_addr) if cfg.metrics_port else None
            )
        except MetricsPortError as err:
            raise ConfigError(str(err)) from None
        base = cfg.log_dir
        if base is None:
            base = Path(tempfile.mkdtemp(prefix="stalwart_"))
        check_component(cfg.run_id)  # it names the monitor's folder too
        self.run_dir: Path | None = None
        if str(base) != os.devnull:
            self.run_dir = make_run_dir(base, cfg.run_id)
        self.events = EventLog(
            self.run_dir / "events.jsonl" if self.run_dir else None,
            run_id=cfg.run_id,
            node_rank=cfg.node_rank,
        )
        if self._metrics is not None:
            self._metrics.watch(self.events.path, start=self.events.start_offset)
        self.logs = LogSpec(
            self.run_dir,
            redirects=cfg.redirects,
            tee=cfg.tee,
            local_ranks_filter=cfg.local_ranks_filter,
            prefix_template=cfg.log_line_prefix_template,
        )
        self._rdzv = rendezvous
        self._ctx: ProcessContext | None = None
        self._guardian: Guardian | None = None
        self._token = uuid.uuid4().hex
        self._stopping = False
        self._old_handlers: dict[int, Any] = {}
        self._hangs: HangWatch | None = None
        self._warm: WarmPool | None = None
        self._defer_signals = False  # set while workers are being started
        self._deferred_signal: int | None = None
        # The first signal the handler raised for; the round loop re-raises it should
        # anything have swallowed the exception.
        self._signal_seen: int | None = None
        self._reason = ""  # why a rank's control request ended the round
        self._cgroup: JobCgroup | None = None
        self._tracked: dict[int, float] = {}  # strays handed to the guardian
        self._snapshots: SnapshotMemory | None = None
        self._replicas: NodeReplicas | None = None
        self._quarantine: QuarantineGuard | None = None  # None: off (guard_for says when)
        self._round = 0  # the attempt under way, for events written on a signal
        self._exits_seen: set[int] = set()  # local ranks whose worker_exit is written
        self._progress: ProgressBoard | None = None
        self._steps_sent: dict[int, tuple[Sample, float]] = {}  # lr -> (sample, sent at)
        self._ranks_run: set[int] = set()  # global ranks this node ran, for the summary
        self._stacks: list[Path] = []  # this attempt's stack-dump files
        self._folder_shown = False
        self._result: JobResult | None = None  # what run() returns, for launcher_exit
        self._rdzv_failed = False  # the job could not form: the launcher exits 3
        self._linger = False  # the job cgroup is still busy: the guardian removes it
        # The crash-loop policy's inputs: the job's failed attempts, the furthest step a
        # local rank reported in this attempt, and checkpoint commits from the event log.
        self._failed_attempts: list[AttemptEnd] = []
        self._furthest_step: int | None = None
        # From where this run starts: a reused run folder holds earlier runs' commits.
        self._commits = EventTail(self.events.path, self.events.start_offset)
