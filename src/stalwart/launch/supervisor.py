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

import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import FrameType
from typing import Any

from stalwart.config import LaunchConfig
from stalwart.launch import posix
from stalwart.launch.errors import ProcessFailure, format_summary, root_cause, signal_name
from stalwart.launch.events import EventLog
from stalwart.launch.logs import LogSpec, WorkerLogs
from stalwart.launch.warm import WarmPool
from stalwart.launch.workers import Guardian, ProcessContext, RunResult, WorkerSpecEntry
from stalwart.monitor import ControlAction, HangReport, NodeMonitor
from stalwart.rendezvous import C10dRendezvous, Rendezvous, RendezvousInfo, StoreEndpoint

logger = logging.getLogger(__name__)

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class State(Enum):
    INIT = "init"
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


class RoundOutcome(Enum):
    SUCCEEDED = "succeeded"
    LOCAL_FAILURE = "local_failure"
    PEER_FAILURE = "peer_failure"
    SHUTDOWN_REQUESTED = "shutdown_requested"


# How long to wait for the monitor's report after a worker it terminated has exited: the
# report is filed microseconds after the signal, so this only bounds a pathological case.
_HANG_REPORT_WAIT = 1.0


class SignalReceived(Exception):
    """A termination signal reached the launcher; the job must stop now."""

    def __init__(self, sig: int) -> None:
        super().__init__(f"launcher received {signal.Signals(sig).name}")
        self.sig = sig


@dataclass
class JobResult:
    exit_code: int
    state: State
    attempts: int
    failures: list[ProcessFailure]
    return_values: dict[int, Any]
    run_dir: Path | None


def build_rendezvous(cfg: LaunchConfig) -> C10dRendezvous:
    """The c10d store the nodes meet at (a private loopback one for a single node)."""
    join_timeout = cfg.join_timeout
    if cfg.nnodes == 1:
        return C10dRendezvous(
            run_id=cfg.run_id,
            nnodes=1,
            endpoint=StoreEndpoint("127.0.0.1", 0),
            host_store=True,
            node_rank=0,
            master_addr=cfg.effective_master_addr,
            join_timeout=join_timeout,
        )
    if cfg.rdzv_backend == "static" or not cfg.rdzv_endpoint:
        endpoint = StoreEndpoint(cfg.effective_master_addr, cfg.master_port)
        if cfg.rdzv_endpoint:
            endpoint = StoreEndpoint.parse(cfg.rdzv_endpoint, cfg.master_port)
        is_host = cfg.node_rank == 0
    else:
        endpoint = StoreEndpoint.parse(cfg.rdzv_endpoint)
        explicit = cfg.rdzv_conf.get("is_host")
        is_host = (
            explicit.lower() in ("1", "true", "yes") if explicit is not None else cfg.node_rank == 0
        )
    return C10dRendezvous(
        run_id=cfg.run_id,
        nnodes=cfg.nnodes,
        endpoint=endpoint,
        host_store=is_host,
        node_rank=cfg.node_rank,
        master_addr=endpoint.host,
        join_timeout=join_timeout,
    )


def worker_env(
    cfg: LaunchConfig, info: RendezvousInfo, local_rank: int, logs: WorkerLogs
) -> dict[str, str]:
    """torchrun's variables, with torchrun's values (checked by a test against torchrun)."""
    rank = info.base_rank + local_rank
    env = {
        "LOCAL_RANK": str(local_rank),
        "RANK": str(rank),
        "GROUP_RANK": str(info.group_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": cfg.role,
        "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
        "WORLD_SIZE": str(info.world_size),
        "GROUP_WORLD_SIZE": str(info.group_world_size),
        "ROLE_WORLD_SIZE": str(info.world_size),
        "MASTER_ADDR": info.master_addr,
        "MASTER_PORT": str(info.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(info.round),
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
        "TORCHELASTIC_RUN_ID": cfg.run_id,
        # Workers join the per-round store the launcher hosts instead of starting one.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCHELASTIC_ERROR_FILE": str(logs.error_file) if logs.error_file else "",
    }
    if cfg.inject:
        env["STALWART_INJECT"] = cfg.inject
    if "OMP_NUM_THREADS" not in os.environ and cfg.nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"
    return env


def program_argv(cfg: LaunchConfig) -> tuple[str, list[str]]:
    """The program and arguments each worker runs."""
    if cfg.no_python:
        return cfg.entrypoint, list(cfg.args)
    boot = ["-u", "-m", "stalwart.launch.bootstrap"]
    if cfg.module:
        return sys.executable, [*boot, "-m", cfg.entrypoint, *cfg.args]
    return sys.executable, [*boot, cfg.entrypoint, *cfg.args]


class Supervisor:
    """Runs one node's share of a job to completion."""

    def __init__(self, cfg: LaunchConfig, rendezvous: Rendezvous | None = None) -> None:
        self.cfg = cfg
        self.state = State.INIT
        base = cfg.log_dir
        if base is None:
            base = Path(tempfile.mkdtemp(prefix="stalwart_"))
        self.run_dir: Path | None = None if str(base) == os.devnull else base / cfg.run_id
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(
            self.run_dir / "events.jsonl" if self.run_dir else None,
            run_id=cfg.run_id,
            node_rank=cfg.node_rank,
        )
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
        self._monitor: NodeMonitor | None = None
        self._warm: WarmPool | None = None
        self._hangs: dict[int, HangReport] = {}  # pid -> report, this round

    # -- signals -----------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stopping:
            # A second signal while stopping: no more grace.
            if self._ctx is not None:
                for pid in self._ctx.pids().values():
                    posix.killpg_quiet(pid, signal.SIGKILL)
            return
        raise SignalReceived(signum)

    def _install_signals(self) -> None:
        for sig in _FORWARDED:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> JobResult:
        cfg = self.cfg
        self._install_signals()
        self.events.emit(
            "launcher_start",
            nnodes=cfg.nnodes,
            nproc_per_node=cfg.nproc_per_node,
            max_restarts=cfg.max_restarts,
            entrypoint=cfg.entrypoint,
            args=cfg.args,
            run_dir=str(self.run_dir) if self.run_dir else None,
        )
        result: JobResult | None = None
        try:
            self.prestart()
            self._monitor = self._start_monitor()
            if self._rdzv is None:
                self._rdzv = build_rendezvous(cfg)
            result = self._loop(self._rdzv)
        except SignalReceived as sig:
            result = self._interrupted(sig.sig)
        finally:
            self._stopping = True
            if self._ctx is not None:
                self._ctx.close(signal.SIGTERM, cfg.shutdown_timeout)
            if self._rdzv is not None:
                self._rdzv.leave()
            if self._guardian is not None:
                self._guardian.close()
            if self._monitor is not None:
                self._monitor.stop()
            if self._warm is not None:
                self._warm.close()
            code = result.exit_code if result is not None else 1
            self.events.emit("launcher_exit", exit_code=code)
            self.events.close()
            self._restore_signals()
        return result

    def prestart(self) -> None:
        """Starts the guardian and the warm template; cheap, and torch-free, so a caller
        can do it before anything imports torch in the launcher (``run`` does it too)."""
        # Before the template forks anything: workers it makes are re-parented to us.
        posix.set_child_subreaper()
        if self._guardian is None:
            self._guardian = Guardian(self._token)
        if self._warm is None:
            self._warm = self._start_warm()

    def _start_warm(self) -> WarmPool | None:
        """The warm template starts now, so its imports overlap the rendezvous."""
        cfg = self.cfg
        if not cfg.warm or cfg.no_python:
            return None
        env = dict(os.environ)
        env["STALWART_RUN_TOKEN"] = self._token
        # Read by OpenMP when torch loads in the template, so it must be the workers' value.
        if "OMP_NUM_THREADS" not in env and cfg.nproc_per_node > 1:
            env["OMP_NUM_THREADS"] = "1"

        def emit(event: str, **fields: Any) -> None:
            self.events.emit(event, **fields)

        log = str(self.run_dir / "template.log") if self.run_dir is not None else os.devnull
        pool = WarmPool(list(cfg.preload), env, emit, log_path=log)
        pool.start()
        return pool

    def _start_monitor(self) -> NodeMonitor:
        """The node's hang monitor: timers always, heartbeats/sections when configured.
        Its pipe and shared memory live in a private local folder (0700), never on the
        log folder, which may be a shared filesystem where named pipes do not work."""
        ipc = Path(tempfile.mkdtemp(prefix=f"stalwart-{self.cfg.run_id}-"))

        def log_event(event: str, fields: dict[str, Any]) -> None:
            self.events.emit(event, **fields)

        mon = NodeMonitor(ipc, self.cfg.monitor, self.cfg.nproc_per_node, log_event)
        mon.start()
        return mon

    def _interrupted(self, sig: int) -> JobResult:
        self._stopping = True
        name = signal.Signals(sig).name
        logger.warning(
            "received %s: stopping workers (grace %.1fs)", name, self.cfg.shutdown_timeout
        )
        self.events.emit("shutdown", signal=name, grace=self.cfg.shutdown_timeout)
        if self._ctx is not None:
            self._ctx.close(sig, self.cfg.shutdown_timeout)
            self._emit_exits(self._ctx, -1)
        self.state = State.INTERRUPTED
        return JobResult(128 + sig, self.state, 0, [], {}, self.run_dir)

    def _loop(self, rdzv: Rendezvous) -> JobResult:
        cfg = self.cfg
        round_ = 0
        while True:
            self.state = State.RENDEZVOUS
            info = rdzv.join(round_, cfg.nproc_per_node)
            self.events.set_node_rank(info.group_rank)
            self.events.emit(
                "rendezvous_done",
                attempt=round_,
                group_rank=info.group_rank,
                group_world_size=info.group_world_size,
                world_size=info.world_size,
                base_rank=info.base_rank,
                master_addr=info.master_addr,
                master_port=info.master_port,
                duration=info.duration,
            )
            outcome, result = self._run_round(rdzv, info)
            if outcome is RoundOutcome.SHUTDOWN_REQUESTED or (
                outcome is RoundOutcome.PEER_FAILURE and self._peer_shutdown(rdzv, round_)
            ):
                self.state = State.FAILED
                self.events.emit("job_stopped", attempt=round_, reason="shutdown requested")
                print(
                    f"stalwart: job {cfg.run_id} stopped at the request of a rank "
                    f"(attempt {round_}); not restarting",
                    file=sys.stderr,
                    flush=True,
                )
                return JobResult(1, self.state, round_ + 1, [], {}, self.run_dir)
            if outcome is RoundOutcome.SUCCEEDED:
                self.state = State.SUCCEEDED
                self.events.emit("job_succeeded", attempt=round_)
                return JobResult(
                    0,
                    self.state,
                    round_ + 1,
                    [],
                    result.return_values if result else {},
                    self.run_dir,
                )
            failures = [
                ProcessFailure.from_dict(f) for f in rdzv.failures(round_) if f["local_rank"] >= 0
            ]
            if not failures and result is not None:
                failures = list(result.failures.values())
            if round_ >= cfg.max_restarts:
                self.state = State.FAILED
                cause = root_cause(failures) if failures else None
                self.events.emit(
                    "job_failed",
                    attempt=round_,
                    root_cause=cause.to_dict() if cause else None,
                )
                if failures:
                    print(
                        format_summary(
                            failures,
                            run_id=cfg.run_id,
                            attempts=round_ + 1,
                            log_dir=str(self.run_dir) if self.run_dir else None,
                        ),
                        file=sys.stderr,
                        flush=True,
                    )
                return JobResult(1, self.state, round_ + 1, failures, {}, self.run_dir)
            cause = root_cause(failures) if failures else None
            self.events.emit(
                "restart",
                attempt=round_,
                next_attempt=round_ + 1,
                reason=outcome.value,
                root_cause=cause.to_dict() if cause else None,
                restarts_left=cfg.max_restarts - round_ - 1,
            )
            if cause is not None:
                logger.warning(
                    "attempt %d failed: rank %s %s%s; restarting (%d of %d)",
                    round_,
                    cause.rank,
                    cause.describe_exit(),
                    f" ({cause.reason or cause.message})" if cause.reason or cause.message else "",
                    round_ + 1,
                    cfg.max_restarts,
                )
            round_ += 1

    def _start(self, info: RendezvousInfo) -> ProcessContext:
        cfg = self.cfg
        n = cfg.nproc_per_node
        ranks = {lr: info.base_rank + lr for lr in range(n)}
        logs = self.logs.make(info.round, n, ranks, cfg.role, info.group_rank)
        program, argv = program_argv(cfg)
        specs = []
        for lr in range(n):
            env = worker_env(cfg, info, lr, logs[lr])
            if self._monitor is not None:
                mon_env = self._monitor.worker_env(lr, ranks[lr])
                # torchrun names its timer pipe only when file timers are enabled; do the
                # same so a worker's environment matches torchrun's (ours has its own name).
                if os.environ.get("TORCHELASTIC_ENABLE_FILE_TIMER") != "1":
                    mon_env.pop("TORCHELASTIC_TIMER_FILE", None)
                env.update(mon_env)
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
        )
        ctx.start()
        self._hangs = {}
        if self._monitor is not None:
            self._monitor.begin_attempt(
                info.round,
                ctx.pids(),
                stderr_paths={lr: p for lr in range(n) if (p := logs[lr].stderr) is not None},
                global_ranks=ranks,
            )
        for lr, pid in ctx.pids().items():
            self.events.emit(
                "worker_spawn", attempt=info.round, local_rank=lr, rank=ranks[lr], worker_pid=pid
            )
        return ctx

    def _run_round(
        self, rdzv: Rendezvous, info: RendezvousInfo
    ) -> tuple[RoundOutcome, RunResult | None]:
        cfg = self.cfg
        self.state = State.RUNNING
        self._ctx = ctx = self._start(info)
        outcome: RoundOutcome | None = None
        result: RunResult | None = None
        last_reap = time.monotonic()
        while outcome is None:
            result = ctx.wait(timeout=cfg.monitor_interval, period=cfg.monitor_interval)
            self._collect_hangs()
            if time.monotonic() - last_reap > 1.0:
                self._reap_orphans(ctx)
                last_reap = time.monotonic()
            if result is not None:
                if result.is_failed():
                    outcome = RoundOutcome.LOCAL_FAILURE
                    self._explain(result, info)
                    cause = root_cause(list(result.failures.values()))
                    rdzv.report_failure(info.round, cause.to_dict())
                else:
                    outcome = self._await_peers(rdzv, info.round)
            elif rdzv.failed(info.round):
                outcome = RoundOutcome.PEER_FAILURE
                self.events.emit("peer_failure", attempt=info.round)
            elif self._shutdown_requested(info):
                outcome = RoundOutcome.SHUTDOWN_REQUESTED
                rdzv.report_failure(
                    info.round,
                    {
                        "local_rank": -1,
                        "pid": os.getpid(),
                        "exitcode": 0,
                        "node_rank": info.group_rank,
                        "reason": "a rank asked to shut the workload down",
                    },
                )
        if self._monitor is not None:
            self._monitor.end_attempt()
        ctx.close(signal.SIGTERM, cfg.shutdown_timeout)
        self._emit_exits(ctx, info.round)
        self._reap_orphans(ctx)
        self._ctx = None
        return outcome, result

    def _reap_orphans(self, ctx: ProcessContext) -> None:
        keep = set(ctx.pids().values())
        for helper in (
            self._guardian.proc.pid if self._guardian else None,
            self._warm.owned_pid() if self._warm else None,
        ):
            if helper is not None:
                keep.add(helper)
        posix.reap_orphans(keep)

    def _collect_hangs(self) -> None:
        if self._monitor is not None:
            for report in self._monitor.poll_hangs():
                self._hangs[report.pid] = report

    def _explain(self, result: RunResult, info: RendezvousInfo) -> None:
        """Marks failures with their node and, for workers the monitor terminated, the
        hang that caused it (its stacks stand in for a traceback)."""
        for f in result.failures.values():
            f.node_rank = info.group_rank
        if self._monitor is None:
            return
        deadline = time.monotonic() + _HANG_REPORT_WAIT
        pending = [f for f in result.failures.values() if f.pid not in self._hangs]
        while pending and time.monotonic() < deadline and self._monitor_killed(pending):
            time.sleep(0.01)
            self._collect_hangs()
            pending = [f for f in pending if f.pid not in self._hangs]
        for f in result.failures.values():
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
            f.reason = ", ".join(bits)
            f.timestamp = min(f.timestamp, hang.detected_at)
            if hang.stacks and not f.traceback:
                f.traceback = hang.stacks

    def _monitor_killed(self, failures: list[ProcessFailure]) -> bool:
        """Whether any of these deaths looks like the monitor's terminate signal."""
        sig = int(self.cfg.monitor.term_signal)
        return any(f.exitcode in (-sig, -int(signal.SIGKILL)) for f in failures)

    def _shutdown_requested(self, info: RendezvousInfo) -> bool:
        if self._monitor is None:
            return False
        stop = False
        for req in self._monitor.poll_requests():
            self.events.emit(
                "control_request",
                attempt=info.round,
                action=req.action.value,
                rank=req.global_rank,
                worker_pid=req.pid,
            )
            if req.action in (ControlAction.SHUTDOWN_WORKLOAD, ControlAction.EXCLUDE_NODE):
                # With static membership a node cannot leave a running job, so excluding
                # this node ends the job as a shutdown does; say so.
                logger.error(
                    "rank %s asked to %s: stopping the job without restart",
                    req.global_rank,
                    req.action.value.replace("_", " "),
                )
                stop = True
        return stop

    def _peer_shutdown(self, rdzv: Rendezvous, round_: int) -> bool:
        return any(f.get("local_rank", 0) < 0 for f in rdzv.failures(round_))

    def _await_peers(self, rdzv: Rendezvous, round_: int) -> RoundOutcome:
        """Local workers succeeded; the job succeeds only if every node's did."""
        rdzv.report_done(round_)
        while not rdzv.all_done(round_):
            if rdzv.failed(round_):
                return RoundOutcome.PEER_FAILURE
            time.sleep(self.cfg.monitor_interval)
        return RoundOutcome.SUCCEEDED

    def _emit_exits(self, ctx: ProcessContext, round_: int) -> None:
        for lr, (rank, pid, code, when) in ctx.exit_info().items():
            self.events.emit(
                "worker_exit",
                attempt=round_,
                local_rank=lr,
                rank=rank,
                worker_pid=pid,
                exitcode=code,
                signal=signal_name(code),
                exited_at=when,
            )
