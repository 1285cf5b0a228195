"""One node's supervisor: rendezvous -> start workers -> watch -> restart | finish | fail.

The supervisor owns the life of a job on its node.  Each round it joins the rendezvous
(job-wide round number = attempt = ``TORCHELASTIC_RESTART_COUNT``), starts the local
workers with torchrun's environment, and watches three things: its own workers (woken
by their exit through pidfds), the other nodes (a failure flag in the store) and the
hang monitor.  Any failure stops every local worker; the job restarts while the budget
lasts, else the root cause is printed and the launcher exits non-zero.  Every state
change goes to ``events.jsonl``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from stalwart.base import envvars, procs
from stalwart.base.events import Event
from stalwart.config import LaunchConfig
from stalwart.launch import signals
from stalwart.launch.cgroup import JobCgroup
from stalwart.launch.decide import (
    Ending,
    Restart,
    RoundOutcome,
    RoundView,
    State,
    Stop,
    control_outcome,
    control_reason,
    decide,
    interrupted,
    not_needed,
)
from stalwart.launch.environment import program_argv, worker_env
from stalwart.launch.errors import ProcessFailure, format_summary, root_cause, signal_name
from stalwart.launch.events import EventLog, read_events
from stalwart.launch.guardian import Guardian
from stalwart.launch.hangs import HangWatch
from stalwart.launch.logs import LogSpec
from stalwart.launch.membership import rendezvous_for
from stalwart.launch.metrics import MetricsServer
from stalwart.launch.monitor_sync import job_peers
from stalwart.launch.replicas import NodeReplicas, advertised_address, effective_replicas
from stalwart.launch.runfiles import check_component, make_run_dir
from stalwart.launch.snapshots import SnapshotMemory
from stalwart.launch.summary import end_block, never_fired
from stalwart.launch.warm import WarmPool
from stalwart.launch.workers import ProcessContext, RunResult, WorkerSpecEntry
from stalwart.monitor import ControlRequest
from stalwart.monitor import envvars as monitor_env
from stalwart.progress import ProgressBoard, Sample
from stalwart.rendezvous import (
    JobEnded,
    NodeExcluded,
    NodeLost,
    Rendezvous,
    RendezvousError,
    RendezvousInfo,
    ShutdownRequested,
    StoreLost,
    WorkerFailed,
)
from stalwart.runlog import EVENTS_FILE_ENV

logger = logging.getLogger(__name__)

_FORWARDED = signals.FORWARDED
# Seconds between reaping orphans, and between scans for strays to hand to the guardian:
# often without a job cgroup (the guardian's only way to find them after a SIGKILL),
# rarely with one (the cgroup holds them all; the scan only reports them).  A scan reads
# the whole process table.
_REAP_EVERY = 1.0
_STRAY_SCAN = 0.5
_STRAY_SCAN_WITH_CGROUP = 5.0
# Progress events a rank writes at most this often (s), besides its first and last.
_PROGRESS_PERIOD = 1.0


class SignalReceived(Exception):
    """A termination signal reached the launcher; the job must stop now."""

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
    failures: list[ProcessFailure]
    return_values: dict[int, Any]
    run_dir: Path | None


class Supervisor:
    """Runs one node's share of a job to completion."""

    def __init__(self, cfg: LaunchConfig, rendezvous: Rendezvous | None = None) -> None:
        self.cfg = cfg
        # First: a taken port is a one-line error before anything is created.
        self._metrics = (
            MetricsServer(cfg.metrics_port, cfg.metrics_addr) if cfg.metrics_port else None
        )
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
            self._metrics.watch(self.events.path)
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
        self._reason = ""  # why a rank's control request ended the round
        self._cgroup: JobCgroup | None = None
        self._tracked: dict[int, float] = {}  # strays handed to the guardian
        self._snapshots: SnapshotMemory | None = None
        self._replicas: NodeReplicas | None = None
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

    # -- signals -----------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._defer_signals:
            if self._deferred_signal is None:
                self._deferred_signal = signum
            return
        if self._stopping:
            # A second signal while stopping: no more grace.
            if self._ctx is not None:
                for pid in self._ctx.pids().values():
                    procs.killpg_quiet(pid, signal.SIGKILL)
            if self._rdzv is not None:
                self._rdzv.interrupt()  # an excluded store host stops serving
            return
        raise SignalReceived(signum)

    def _install_signals(self) -> None:
        # torchrun's four always (a worker must never be orphaned), plus those asked for.
        asked = tuple(signal.Signals[name] for name in self.cfg.signals_to_handle)
        for sig in dict.fromkeys((*_FORWARDED, *asked)):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> JobResult:
        cfg = self.cfg
        self.events.emit(
            Event.LAUNCHER_START,
            nnodes=cfg.nnodes,
            nproc_per_node=cfg.nproc_per_node,
            max_restarts=cfg.max_restarts,
            entrypoint=cfg.entrypoint,
            args=cfg.args,
            run_dir=str(self.run_dir) if self.run_dir else None,
            inject=cfg.inject or None,
        )
        with contextlib.ExitStack() as teardown:
            # Each step runs whatever an earlier one raised (the first error is re-raised
            # once all have run): a store that is gone must not leave the workers, the
            # monitor or the guardian behind.
            for step in reversed(self._teardown_steps()):
                teardown.callback(step)
            try:
                self._install_signals()
                early = signals.pending()
                if early is not None:  # arrived while the launcher was still starting
                    signals.clear()
                    raise SignalReceived(early)
                result = self._loop(self._set_up())
            except SignalReceived as sig:
                result = self._interrupted(sig.sig)
            except RendezvousError as err:
                # The CLI reports it in one line and exits 3; the event log says the same.
                self.events.emit(Event.RENDEZVOUS_ERROR, error=str(err))
                self._rdzv_failed = True
                if self._rdzv is not None and not isinstance(err, StoreLost):
                    # The job cannot form (e.g. too few nodes): spares waiting stop too.
                    self._rdzv.finish(False, str(err))
                raise
            self._result = result
            return result

    def _set_up(self) -> Rendezvous:
        """Everything a round needs besides the rendezvous' answer; returns the
        rendezvous (made from the configuration unless one was given)."""
        cfg = self.cfg
        self.prestart()
        # The guardian learns the monitor folder the moment it exists, before the
        # monitor starts, so a SIGKILL at any later point leaves no folder behind.
        self._hangs = HangWatch(
            cfg.run_id,
            cfg.monitor,
            cfg.nproc_per_node,
            self.events.emit,
            on_folder=self._guardian.remove_on_death if self._guardian else None,
            # Learned timeouts and hang dossiers live in the run folder.
            state_dir=self.run_dir,
        )
        self._progress = ProgressBoard(self._hangs.ipc, cfg.nproc_per_node)
        if cfg.ckpt_ram:
            self._snapshots = SnapshotMemory(cfg.nproc_per_node, cfg.ckpt_ram)
            if self._guardian is not None:
                self._guardian.remove_on_death(self._snapshots.folder)
            self.events.emit(
                Event.CKPT_RAM_RESERVED,
                folder=str(self._snapshots.folder),
                bytes_per_rank=cfg.ckpt_ram,
                segment_bytes=self._snapshots.segment_bytes,
            )
        if self._rdzv is None:
            self._rdzv = rendezvous_for(cfg)
        self._start_replicas(self._rdzv)
        return self._rdzv

    def _start_replicas(self, rdzv: Rendezvous) -> None:
        k = effective_replicas(self.cfg.ckpt_replicas, self.cfg.max_nodes)
        where = advertised_address(rdzv) if self._snapshots is not None and k else None
        if self._snapshots is not None and where is not None:
            kv, addr = where
            self._replicas = NodeReplicas(
                self._snapshots.folder,
                self._snapshots.slot_bytes,
                self.cfg.nproc_per_node,
                k,
                kv,
                addr,
                self.events.emit,
                max_nodes=self.cfg.max_nodes,
            )

    # -- teardown ----------------------------------------------------------------------
    def _teardown_steps(self) -> list[Callable[[], object]]:
        """What ``run`` closes when it ends, in this order.  Each step looks at what
        exists when it runs: ``run`` may end before a resource was made."""
        return [
            # First: no warm template is forked while the rest is torn down.
            lambda: self._warm.stop_learning() if self._warm is not None else None,
            self._stop_workers,
            lambda: self._rdzv.leave() if self._rdzv is not None else None,
            lambda: self._progress.close() if self._progress is not None else None,
            lambda: self._hangs.stop() if self._hangs is not None else None,
            lambda: self._warm.close() if self._warm is not None else None,
            # Before the snapshots: its server and pushes read the snapshot folder.
            lambda: self._replicas.close() if self._replicas is not None else None,
            lambda: self._snapshots.close() if self._snapshots is not None else None,
            self._remove_cgroup,
            # Late: until the guardian is told to exit it still removes what is left (the
            # monitor folder, stray processes) should this process be SIGKILLed now.
            lambda: self._guardian.close(linger=self._linger) if self._guardian else None,
            self._write_exit,
            self.events.close,
            lambda: self._metrics.close() if self._metrics is not None else None,
            self._restore_signals,
        ]

    def _stop_workers(self) -> None:
        self._stopping = True
        if self._ctx is not None:
            self._ctx.close(signal.SIGTERM, self.cfg.shutdown_timeout)

    def _remove_cgroup(self) -> None:
        # A process stuck in uninterruptible sleep keeps the cgroup busy: the guardian
        # then stays behind and removes it once the process is gone.
        # (Workers were given their KILL_WAIT already: no second long wait here.)
        self._linger = self._cgroup is not None and not self._cgroup.remove(timeout=1.0)

    def _write_exit(self) -> None:
        result = self._result
        code = result.exit_code if result is not None else (3 if self._rdzv_failed else 1)
        closing: dict[str, Any] = {}
        if result is not None and result.attempts > 0:  # not a spare never admitted
            closing = self._end_report(result)
        # The closing figures ride on launcher_exit: the job's last events stay
        # job_succeeded | job_failed | job_stopped, then launcher_exit.
        self.events.emit(Event.LAUNCHER_EXIT, exit_code=code, **closing)

    def _end_report(self, result: JobResult) -> dict[str, Any]:
        """The job's closing block on the console, and faults that never fired; returns
        the fields for ``launcher_exit`` (``goodput``, ``inject_not_fired``)."""
        path = self.events.path
        if path is None or not path.is_file():
            return {}
        fields: dict[str, Any] = {}
        try:
            events = list(read_events(path))
            unfired = never_fired(self.cfg.inject, events, self._ranks_run)
            if unfired:
                fields["inject_not_fired"] = unfired
            for spec in unfired:
                print(
                    f"stalwart: warning: --inject fault {spec!r} never fired "
                    "(does the script call stalwart.inject.step(step) each step?)",
                    file=sys.stderr,
                    flush=True,
                )
            block, breakdown = end_block(
                events,
                now=time.time(),
                run_id=self.cfg.run_id,
                outcome=result.state.value,
                attempts=result.attempts,
                run_dir=str(self.run_dir) if self.run_dir else None,
            )
        except (OSError, ValueError, KeyError, TypeError) as err:
            # A summary must never turn a finished job into a failed launcher.
            logger.warning("could not summarise the run: %s", err)
            return fields
        fields["goodput"] = {**breakdown.seconds, "ratio": breakdown.goodput}
        print(block, file=sys.stderr, flush=True)
        return fields

    def prestart(self) -> None:
        """Starts the guardian and the warm template; cheap, and torch-free, so a caller
        can do it before anything imports torch in the launcher (``run`` does it too)."""
        # Before the template forks anything: workers it makes are re-parented to us.
        procs.set_child_subreaper()
        if self._guardian is None:
            self._guardian = Guardian(self._token)
            self._cgroup = JobCgroup.create(self._token, self._guardian.kill_cgroup_on_death)
            if self._cgroup is not None:
                logger.debug("job cgroup %s", self._cgroup.path)
        if self._warm is None:
            self._warm = self._start_warm()
            template = self._warm.template_pid() if self._warm is not None else None
            if self._cgroup is not None and template is not None:
                # Workers it forks are born in the job's cgroup.
                self._cgroup.join(template)

    def _start_warm(self) -> WarmPool | None:
        """The warm template starts now, so its imports overlap the rendezvous."""
        cfg = self.cfg
        if not cfg.warm or cfg.no_python:
            return None
        env = dict(os.environ)
        env[envvars.RUN_TOKEN] = self._token
        # OpenMP reads it when torch loads in the template; with more than one thread the
        # template could not fork.  Workers that should have more get them back after the
        # fork (zygote._become_worker).
        env.setdefault(envvars.OMP_NUM_THREADS, "1")

        log = str(self.run_dir / "template.log") if self.run_dir is not None else os.devnull
        # Room in the template's command line for a worker's title (bootstrap.set_title).
        room = len(" ".join([sys.executable, "-u", *program_argv(cfg)[1][3:]])) + 1
        pool = WarmPool(list(cfg.preload), env, self.events.emit, log_path=log, title_room=room)
        pool.start()
        return pool

    def _interrupted(self, sig: int) -> JobResult:
        self._stopping = True
        name = signal.Signals(sig).name
        logger.warning(
            "received %s: stopping workers (grace %.1fs)", name, self.cfg.shutdown_timeout
        )
        self.events.emit(Event.SHUTDOWN, signal=name, grace=self.cfg.shutdown_timeout)
        if self._ctx is not None:
            self._ctx.close(sig, self.cfg.shutdown_timeout)
            self._drop_empty_stacks()
            self._emit_exits(self._ctx, self._round)
        return self._stop(interrupted(sig, self._round))

    def _loop(self, rdzv: Rendezvous) -> JobResult:
        """join -> run the round -> decide -> act, until a move stops the job."""
        attempt = 0
        while True:
            try:
                info = self._join(rdzv, attempt)
            except JobEnded as ended:
                return self._stop(not_needed(ended.succeeded, ended.reason))
            if self._replicas is not None:
                self._replicas.begin_round(
                    info.round,
                    info.group_rank,
                    info.group_world_size,
                    info.base_rank,
                    info.world_size,
                )
            outcome, result = self._run_round(rdzv, info)
            records = rdzv.failures(info.round) if outcome is not RoundOutcome.SUCCEEDED else []
            view = RoundView(
                outcome, info.round, self.cfg.max_restarts, tuple(records), self._reason
            )
            move = decide(view)
            if isinstance(move, Stop):
                return self._stop(move, result)
            self._restart(move, result)
            attempt = move.next_attempt

    def _join(self, rdzv: Rendezvous, attempt: int) -> RendezvousInfo:
        info = rdzv.join(attempt, self.cfg.nproc_per_node)
        # A node that arrived late (a spare) joins the job's current round.
        self._round = info.round
        self.events.set_node_rank(info.group_rank)
        self.events.emit(
            Event.RENDEZVOUS_DONE,
            attempt=info.round,
            group_rank=info.group_rank,
            group_world_size=info.group_world_size,
            world_size=info.world_size,
            base_rank=info.base_rank,
            master_addr=info.master_addr,
            master_port=info.master_port,
            duration=info.duration,
        )
        if not self._folder_shown and self.run_dir is not None:
            # Once the job forms, before any worker speaks (a store that cannot be
            # reached stays a one-line error).
            self._folder_shown = True
            print(f"stalwart: run folder {self.run_dir}", file=sys.stderr, flush=True)
        if info.left:
            self.events.emit(Event.NODES_LEFT, attempt=info.round, nodes=list(info.left))
            logger.warning(
                "attempt %d goes on with %d node(s) (%d workers) without %s",
                info.round,
                info.group_world_size,
                info.world_size,
                ", ".join(info.left),
            )
        return info

    # -- acting on a move --------------------------------------------------------------
    def _failures(
        self, workers: tuple[WorkerFailed, ...], result: RunResult | None
    ) -> list[ProcessFailure]:
        """The failed workers every node reported, else this node's own."""
        failures = [ProcessFailure.from_record(w) for w in workers]
        if not failures and result is not None:
            failures = list(result.failures.values())
        return failures

    def _emit_departed(self, departed: tuple[NodeLost | NodeExcluded, ...], attempt: int) -> None:
        for gone in departed:
            self.events.emit(
                Event.NODE_LOST if isinstance(gone, NodeLost) else Event.NODE_EXCLUDED,
                attempt=attempt,
                lost_node_rank=gone.node_rank,
                lost_host=gone.host,
                reason=gone.reason,
            )
            logger.warning("attempt %d: %s", attempt, gone.reason)

    def _restart(self, move: Restart, result: RunResult | None) -> None:
        self._emit_departed(move.departed, move.attempt)
        failures = self._failures(move.workers, result)
        cause = root_cause(failures) if failures else None
        self.events.emit(
            Event.RESTART,
            attempt=move.attempt,
            next_attempt=move.next_attempt,
            reason=move.reason,
            root_cause=cause.to_dict() if cause else None,
            restarts_left=move.restarts_left,
        )
        if cause is not None:
            logger.warning(
                "attempt %d failed: rank %s %s%s; restarting (%d of %d)",
                move.attempt,
                cause.rank,
                cause.describe_exit(),
                f" ({cause.reason or cause.message})" if cause.reason or cause.message else "",
                move.next_attempt,
                self.cfg.max_restarts,
            )

    def _stop(self, move: Stop, result: RunResult | None = None) -> JobResult:
        """Says how the job ended on this node (events, console, the other nodes) and
        makes the ``JobResult``: the one place one is made."""
        cfg = self.cfg
        attempt = move.attempts - 1
        self._emit_departed(move.departed, attempt)
        failures = self._failures(move.workers, result) if move.ending is Ending.GAVE_UP else []
        match move.ending:
            case Ending.SUCCEEDED:
                self.events.emit(Event.JOB_SUCCEEDED, attempt=attempt)
            case Ending.GAVE_UP:
                cause = root_cause(failures) if failures else None
                self.events.emit(
                    Event.JOB_FAILED, attempt=attempt, root_cause=cause.to_dict() if cause else None
                )
            case Ending.SHUT_DOWN | Ending.INTERRUPTED:
                self.events.emit(Event.JOB_STOPPED, attempt=attempt, reason=move.reason)
            case Ending.EXCLUDED:
                self.events.emit(Event.NODE_EXCLUDED, attempt=attempt, reason=move.reason)
            case Ending.NOT_NEEDED:
                self.events.emit(Event.JOB_ENDED_WITHOUT_THIS_NODE, reason=move.reason)
        if move.tell is not None and self._rdzv is not None:
            self._rdzv.finish(move.tell.succeeded, move.tell.reason)
        line = ""
        match move.ending:
            case Ending.GAVE_UP if failures:
                line = format_summary(
                    failures,
                    run_id=cfg.run_id,
                    attempts=move.attempts,
                    log_dir=str(self.run_dir) if self.run_dir else None,
                )
            case Ending.SHUT_DOWN:
                line = (
                    f"stalwart: job {cfg.run_id} stopped in attempt {attempt}: {move.reason}; "
                    "not restarting"
                )
            case Ending.EXCLUDED:
                line = (
                    f"stalwart: this node left job {cfg.run_id} in attempt {attempt}: "
                    f"{move.reason}; the job goes on with the other nodes"
                )
            case Ending.NOT_NEEDED:
                line = f"stalwart: job {cfg.run_id} ended without needing this node ({move.reason})"
        if line:
            print(line, file=sys.stderr, flush=True)
        succeeded = move.ending is Ending.SUCCEEDED
        return JobResult(
            exit_code=move.exit_code,
            state=move.state,
            attempts=move.attempts,
            failures=failures,
            return_values=result.return_values if succeeded and result is not None else {},
            run_dir=self.run_dir,
        )

    def _start(self, info: RendezvousInfo) -> ProcessContext:
        cfg = self.cfg
        n = cfg.nproc_per_node
        ranks = {lr: info.base_rank + lr for lr in range(n)}
        logs = self.logs.make(info.round, n, ranks, cfg.role, info.group_rank)
        adir = self.logs.attempt_dir(info.round)
        # Stack dumps go to the rank's own folder, never to a console shared by ranks.
        stacks = {lr: adir / str(lr) / "stacks.log" for lr in range(n)} if adir else {}
        self._stacks = list(stacks.values())
        program, argv = program_argv(cfg)
        specs = []
        for lr in range(n):
            env = worker_env(cfg, info, lr, logs[lr])
            if self._hangs is not None:
                env.update(self._hangs.worker_env(lr, ranks[lr]))
                if lr in stacks:
                    env[monitor_env.STACKS_FILE] = str(stacks[lr])
            if self._snapshots is not None:
                env.update(self._snapshots.worker_env())
            if self._progress is not None:
                env.update(self._progress.worker_env(lr))
            if self.events.path is not None:
                env[EVENTS_FILE_ENV] = str(self.events.path)
            specs.append(WorkerSpecEntry(lr, tuple(argv), env, logs[lr], ranks[lr]))
        ctx = ProcessContext(
            program,
            specs,
            start_method=cfg.start_method,
            run_token=self._token,
            guardian=self._guardian,
            autoclose=False,
            warm=self._warm,
            warm_argv=argv[3:] if self._warm is not None else None,
            wait_all=cfg.restart_policy == "all-failed",
            cgroup=self._cgroup,
            adopt_orphans=True,
        )
        # A signal that arrives while workers are being started waits until all of them
        # are known (a worker forked from the template runs before its pid comes back),
        # so that each of them gets it forwarded, not a SIGKILL at cleanup.
        self._ctx = ctx
        self._deferred_signal = None
        self._defer_signals = True
        try:
            ctx.start()
        finally:
            self._defer_signals = False
        if self._deferred_signal is not None:
            raise SignalReceived(self._deferred_signal)
        if self._hangs is not None:
            dumps = stacks or {lr: p for lr in range(n) if (p := logs[lr].stderr) is not None}
            peers = job_peers(self._rdzv, info)
            self._hangs.begin(info.round, ctx.pids(), dumps, ranks, peers)
        for lr, pid in ctx.pids().items():
            self.events.emit(
                Event.WORKER_SPAWN,
                attempt=info.round,
                local_rank=lr,
                rank=ranks[lr],
                worker_pid=pid,
            )
        return ctx

    def _run_round(
        self, rdzv: Rendezvous, info: RendezvousInfo
    ) -> tuple[RoundOutcome, RunResult | None]:
        cfg = self.cfg
        self._exits_seen = set()
        self._steps_sent = {}
        if self._progress is not None:
            self._progress.clear()
        self._ctx = ctx = self._start(info)
        ranks = {lr: info.base_rank + lr for lr in range(cfg.nproc_per_node)}
        self._ranks_run.update(ranks.values())
        outcome: RoundOutcome | None = None
        result: RunResult | None = None
        last_reap = last_scan = time.monotonic()
        scan_every = _STRAY_SCAN if self._cgroup is None else _STRAY_SCAN_WITH_CGROUP
        while outcome is None:
            result = ctx.wait(timeout=cfg.monitor_interval, period=cfg.monitor_interval)
            if self._hangs is not None:
                self._hangs.collect()
            # Written as the exit is seen, not after the attempt's teardown.
            self._emit_exits(ctx, info.round, exited_only=True)
            self._emit_progress(info.round, ranks, final=False)
            if time.monotonic() - last_reap > _REAP_EVERY:
                self._reap_orphans(ctx)
                last_reap = time.monotonic()
            if time.monotonic() - last_scan > scan_every:
                self._track_strays(ctx, info.round)
                last_scan = time.monotonic()
            if result is not None:
                if result.is_failed() and self._completed_without(result, info):
                    outcome = self._await_peers(rdzv, info.round)
                elif result.is_failed():
                    outcome = RoundOutcome.LOCAL_FAILURE
                    for f in result.failures.values():
                        f.node_rank = info.group_rank
                    if self._hangs is not None:
                        self._hangs.explain(list(result.failures.values()))
                    cause = root_cause(list(result.failures.values()))
                    rdzv.report_failure(info.round, cause.to_record())
                else:
                    outcome = self._await_peers(rdzv, info.round)
            elif rdzv.failed(info.round):
                outcome = RoundOutcome.PEER_FAILURE
                self.events.emit(Event.PEER_FAILURE, attempt=info.round)
            elif self._hangs is not None and (req := self._hangs.control_request(info.round)):
                outcome = self._on_request(rdzv, info, req)
        self._emit_progress(info.round, ranks, final=True)
        self.events.emit(Event.WORKERS_STOPPING, attempt=info.round, reason=outcome.value)
        if self._hangs is not None:
            self._hangs.end()
        ctx.close(signal.SIGTERM, cfg.shutdown_timeout)
        self._drop_empty_stacks()
        if outcome is RoundOutcome.LOCAL_FAILURE and result is not None:
            self._explain_late(rdzv, info.round, result)
        self._emit_exits(ctx, info.round)
        self._reap_orphans(ctx)
        self._ctx = None
        return outcome, result

    def _explain_late(self, rdzv: Rendezvous, round_: int, result: RunResult) -> None:
        """A hang report filed after the death was acted on (the teardown did not wait for
        it) still names the hang in this node's failure record, hence in the summary."""
        if self._hangs is None:
            return
        failures = list(result.failures.values())
        if failures and self._hangs.explain(failures):
            rdzv.report_failure(round_, root_cause(failures).to_record())

    def _on_request(
        self, rdzv: Rendezvous, info: RendezvousInfo, req: ControlRequest
    ) -> RoundOutcome | None:
        outcome = control_outcome(req.action, rdzv.elastic)
        if outcome is None:
            return None
        self._reason = reason = control_reason(req, outcome, info.group_rank)
        logger.error(
            "%s: %s",
            reason,
            "stopping the job without restart"
            if outcome is RoundOutcome.SHUTDOWN_REQUESTED
            else "this node leaves",
        )
        shutdown = outcome is RoundOutcome.SHUTDOWN_REQUESTED
        if shutdown:
            # Ended before the round is failed, so that no spare starts a new round.
            rdzv.finish(False, reason)
        kind = ShutdownRequested if shutdown else NodeExcluded
        rdzv.report_failure(
            info.round,
            kind(
                pid=os.getpid(), node_rank=info.group_rank, host=socket.gethostname(), reason=reason
            ),
        )
        return outcome

    def _reap_orphans(self, ctx: ProcessContext) -> None:
        keep = set(ctx.pids().values())
        if self._guardian is not None:
            keep.add(self._guardian.proc.pid)
        if self._warm is not None:
            keep |= self._warm.owned_pids()
        procs.reap_orphans(keep)

    def _track_strays(self, ctx: ProcessContext, attempt: int) -> None:
        """Processes that left the workers' groups are reported once and handed to the
        guardian, which kills them should this process be SIGKILLed.  With a job cgroup
        the guardian kills them anyway; without one, this is the only net for a daemon
        that also cleared its environment."""
        for pid, started in ctx.strays().items():
            if self._tracked.get(pid) == started:
                continue
            self._tracked[pid] = started
            if self._guardian is not None:
                self._guardian.track(pid, started)
            self.events.emit(Event.STRAY_PROCESS, attempt=attempt, pid=pid)

    def _completed_without(self, result: RunResult, info: RendezvousInfo) -> bool:
        """Under the all-failed policy, workers that completed finished the job without
        the ones that left (the in-process wrapper carried on without them)."""
        if self.cfg.restart_policy != "all-failed":
            return False
        left = sorted(f.rank for f in result.failures.values() if f.rank is not None)
        if len(result.failures) == self.cfg.nproc_per_node:
            return False
        logger.warning(
            "attempt %d completed without rank(s) %s, which left the job", info.round, left
        )
        self.events.emit(Event.RANKS_LEFT, attempt=info.round, ranks=left)
        return True

    def _await_peers(self, rdzv: Rendezvous, round_: int) -> RoundOutcome:
        """Local workers succeeded; the job succeeds only if every node's did."""
        rdzv.report_done(round_)
        while not rdzv.all_done(round_):
            if rdzv.failed(round_):
                return RoundOutcome.PEER_FAILURE
            time.sleep(self.cfg.monitor_interval)
        return RoundOutcome.SUCCEEDED

    def _drop_empty_stacks(self) -> None:
        """Every Python worker opens its stacks.log up front (a signal handler cannot);
        the ones no hang wrote to are not left behind."""
        for path in self._stacks:
            try:
                if path.stat().st_size == 0:
                    path.unlink()
            except FileNotFoundError:
                pass

    def _emit_progress(self, round_: int, ranks: dict[int, int], final: bool) -> None:
        """A ``progress`` event per rank when its step moved: the first step of an
        attempt at once, then at most one a second, and the last one at the end."""
        if self._progress is None:
            return
        now = time.monotonic()
        for lr, sample in self._progress.read().items():
            sent = self._steps_sent.get(lr)
            if sent is not None and (
                sent[0] == sample or (not final and now - sent[1] < _PROGRESS_PERIOD)
            ):
                continue
            wall = time.time() - now  # monotonic -> wall clock
            steps = [(sample.step, sample.at)]
            if sent is None and sample.first_step != sample.step:
                # Where this rank resumed, exactly, though sampled after a few steps.
                steps.insert(0, (sample.first_step, sample.first_at))
            self._steps_sent[lr] = (sample, now)
            for step, at in steps:
                self.events.emit(
                    Event.PROGRESS,
                    attempt=round_,
                    local_rank=lr,
                    rank=ranks.get(lr),
                    step=step,
                    step_time=wall + at,
                )

    def _emit_exits(self, ctx: ProcessContext, round_: int, exited_only: bool = False) -> None:
        for lr, (rank, pid, code, when) in ctx.exit_info().items():
            if lr in self._exits_seen or (exited_only and code is None):
                continue
            self._exits_seen.add(lr)
            self.events.emit(
                Event.WORKER_EXIT,
                attempt=round_,
                local_rank=lr,
                rank=rank,
                worker_pid=pid,
                exitcode=code,
                signal=signal_name(code),
                exited_at=when,
            )
