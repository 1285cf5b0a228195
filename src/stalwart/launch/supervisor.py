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
from stalwart.launch.environment import program_argv, worker_env
from stalwart.launch.errors import ProcessFailure, format_summary, root_cause, signal_name
from stalwart.launch.events import EventLog, read_events
from stalwart.launch.guardian import TOKEN_ENV, Guardian
from stalwart.launch.hangs import HangWatch
from stalwart.launch.logs import LogSpec
from stalwart.launch.metrics import MetricsServer
from stalwart.launch.summary import end_block, never_fired
from stalwart.launch.warm import WarmPool
from stalwart.launch.workers import ProcessContext, RunResult, WorkerSpecEntry
from stalwart.monitor import envvars as monitor_env
from stalwart.progress import ProgressBoard, Sample
from stalwart.rendezvous import (
    JobEnded,
    Rendezvous,
    RendezvousError,
    RendezvousInfo,
    StoreLost,
    from_config,
)
from stalwart.runlog import EVENTS_FILE_ENV

logger = logging.getLogger(__name__)

# Progress events a rank writes at most this often (s), besides its first and last.
_PROGRESS_PERIOD = 1.0

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


class Supervisor:
    """Runs one node's share of a job to completion."""

    def __init__(self, cfg: LaunchConfig, rendezvous: Rendezvous | None = None) -> None:
        self.cfg = cfg
        self.state = State.INIT
        # First: a taken port is a one-line error before anything is created.
        self._metrics = (
            MetricsServer(cfg.metrics_port, cfg.metrics_addr) if cfg.metrics_port else None
        )
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
        self._round = 0  # the attempt under way, for events written on a signal
        self._exits_seen: set[int] = set()  # local ranks whose worker_exit is written
        self._progress: ProgressBoard | None = None
        self._steps_sent: dict[int, tuple[Sample, float]] = {}  # lr -> (sample, sent at)
        self._ranks_run: set[int] = set()  # global ranks this node ran, for the summary
        self._stacks: list[Path] = []  # this attempt's stack-dump files
        self._folder_shown = False

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
            inject=cfg.inject or None,
        )
        result: JobResult | None = None
        rdzv_failed = False
        try:
            self.prestart()
            self._hangs = HangWatch(cfg.run_id, cfg.monitor, cfg.nproc_per_node, self.events.emit)
            self._progress = ProgressBoard(self._hangs.ipc, cfg.nproc_per_node)
            if self._guardian is not None:
                self._guardian.remove_on_death(self._hangs.ipc)
            if self._rdzv is None:
                self._rdzv = from_config(cfg)
            result = self._loop(self._rdzv)
        except SignalReceived as sig:
            result = self._interrupted(sig.sig)
        except RendezvousError as err:
            # The CLI reports it in one line and exits 3; the event log says the same.
            self.state = State.FAILED
            self.events.emit("rendezvous_error", error=str(err))
            rdzv_failed = True
            if self._rdzv is not None and not isinstance(err, StoreLost):
                # The job cannot form (e.g. too few nodes): spares waiting for it stop too.
                self._rdzv.finish(False, str(err))
            raise
        finally:
            self._stopping = True
            if self._ctx is not None:
                self._ctx.close(signal.SIGTERM, cfg.shutdown_timeout)
            if self._rdzv is not None:
                self._rdzv.leave()
            if self._guardian is not None:
                self._guardian.close()
            if self._progress is not None:
                self._progress.close()
            if self._hangs is not None:
                self._hangs.stop()
            if self._warm is not None:
                self._warm.close()
            code = result.exit_code if result is not None else (3 if rdzv_failed else 1)
            closing: dict[str, Any] = {}
            if result is not None and result.attempts > 0:  # not a spare never admitted
                closing = self._end_report(result)
            # The closing figures ride on launcher_exit: the job's last events stay
            # job_succeeded | job_failed | job_stopped, then launcher_exit.
            self.events.emit("launcher_exit", exit_code=code, **closing)
            self.events.close()
            if self._metrics is not None:
                self._metrics.close()
            self._restore_signals()
        return result

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
        env[TOKEN_ENV] = self._token
        # OpenMP reads it when torch loads in the template; with more than one thread the
        # template could not fork.  Workers that should have more get them back after the
        # fork (zygote._become_worker).
        env.setdefault("OMP_NUM_THREADS", "1")

        log = str(self.run_dir / "template.log") if self.run_dir is not None else os.devnull
        pool = WarmPool(list(cfg.preload), env, self.events.emit, log_path=log)
        pool.start()
        return pool

    def _interrupted(self, sig: int) -> JobResult:
        self._stopping = True
        name = signal.Signals(sig).name
        logger.warning(
            "received %s: stopping workers (grace %.1fs)", name, self.cfg.shutdown_timeout
        )
        self.events.emit("shutdown", signal=name, grace=self.cfg.shutdown_timeout)
        if self._ctx is not None:
            self._ctx.close(sig, self.cfg.shutdown_timeout)
            self._drop_empty_stacks()
            self._emit_exits(self._ctx, self._round)
        self.state = State.INTERRUPTED
        self.events.emit("job_stopped", attempt=self._round, reason=f"signal {name}")
        return JobResult(128 + sig, self.state, self._round + 1, [], {}, self.run_dir)

    def _loop(self, rdzv: Rendezvous) -> JobResult:
        cfg = self.cfg
        round_ = 0
        while True:
            self.state = State.RENDEZVOUS
            try:
                info = rdzv.join(round_, cfg.nproc_per_node)
            except JobEnded as ended:
                return self._not_needed(ended)
            # A node that arrived late (a spare) joins the job's current round.
            round_ = self._round = info.round
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
            if not self._folder_shown and self.run_dir is not None:
                # Once the job forms, before any worker speaks (a store that cannot be
                # reached stays a one-line error).
                self._folder_shown = True
                print(f"stalwart: run folder {self.run_dir}", file=sys.stderr, flush=True)
            if info.left:
                self.events.emit("nodes_left", attempt=round_, nodes=list(info.left))
                logger.warning(
                    "attempt %d goes on with %d node(s) (%d workers) without %s",
                    round_,
                    info.group_world_size,
                    info.world_size,
                    ", ".join(info.left),
                )
            outcome, result = self._run_round(rdzv, info)
            if outcome is RoundOutcome.SHUTDOWN_REQUESTED or (
                outcome is RoundOutcome.PEER_FAILURE and self._peer_shutdown(rdzv, round_)
            ):
                self.state = State.FAILED
                self.events.emit("job_stopped", attempt=round_, reason="shutdown requested")
                rdzv.finish(False, "a rank asked to shut the workload down")
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
                rdzv.finish(True, f"succeeded in attempt {round_}")
                return JobResult(
                    0,
                    self.state,
                    round_ + 1,
                    [],
                    result.return_values if result else {},
                    self.run_dir,
                )
            records = rdzv.failures(round_)
            failures = [ProcessFailure.from_dict(f) for f in records if f["local_rank"] >= 0]
            for lost in (f for f in records if f.get("kind") == "node_lost"):
                self.events.emit(
                    "node_lost",
                    attempt=round_,
                    lost_node_rank=lost.get("node_rank"),
                    lost_host=lost.get("host"),
                    reason=lost.get("reason"),
                )
                logger.warning("attempt %d: %s", round_, lost.get("reason"))
            if not failures and result is not None:
                failures = list(result.failures.values())
            if round_ >= cfg.max_restarts:
                self.state = State.FAILED
                rdzv.finish(False, f"failed after {round_ + 1} attempt(s)")
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

    def _not_needed(self, ended: JobEnded) -> JobResult:
        """A spare that was never admitted: the job ended without needing it."""
        self.state = State.SUCCEEDED if ended.succeeded else State.FAILED
        self.events.emit("job_ended_without_this_node", reason=ended.reason)
        print(
            f"stalwart: job {self.cfg.run_id} ended without needing this node ({ended.reason})",
            file=sys.stderr,
            flush=True,
        )
        return JobResult(0 if ended.succeeded else 1, self.state, 0, [], {}, self.run_dir)

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
        )
        ctx.start()
        if self._hangs is not None:
            dumps = stacks or {lr: p for lr in range(n) if (p := logs[lr].stderr) is not None}
            self._hangs.begin(info.round, ctx.pids(), dumps, ranks)
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
        self._exits_seen = set()
        self._steps_sent = {}
        if self._progress is not None:
            self._progress.clear()
        self._ctx = ctx = self._start(info)
        ranks = {lr: info.base_rank + lr for lr in range(cfg.nproc_per_node)}
        self._ranks_run.update(ranks.values())
        outcome: RoundOutcome | None = None
        result: RunResult | None = None
        last_reap = time.monotonic()
        while outcome is None:
            result = ctx.wait(timeout=cfg.monitor_interval, period=cfg.monitor_interval)
            if self._hangs is not None:
                self._hangs.collect()
            # Written as the exit is seen, not after the attempt's teardown.
            self._emit_exits(ctx, info.round, exited_only=True)
            self._emit_progress(info.round, ranks, final=False)
            if time.monotonic() - last_reap > 1.0:
                self._reap_orphans(ctx)
                last_reap = time.monotonic()
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
                    rdzv.report_failure(info.round, cause.to_dict())
                else:
                    outcome = self._await_peers(rdzv, info.round)
            elif rdzv.failed(info.round):
                outcome = RoundOutcome.PEER_FAILURE
                self.events.emit("peer_failure", attempt=info.round)
            elif self._hangs is not None and self._hangs.stop_requested(info.round):
                outcome = RoundOutcome.SHUTDOWN_REQUESTED
                # Ended before the round is failed, so that no spare starts a new round.
                rdzv.finish(False, "a rank asked to shut the workload down")
                rdzv.report_failure(
                    info.round,
                    {
                        "kind": "shutdown",
                        "local_rank": -1,
                        "pid": os.getpid(),
                        "exitcode": 0,
                        "node_rank": info.group_rank,
                        "reason": "a rank asked to shut the workload down",
                    },
                )
        self._emit_progress(info.round, ranks, final=True)
        if self._hangs is not None:
            self._hangs.end()
        ctx.close(signal.SIGTERM, cfg.shutdown_timeout)
        self._drop_empty_stacks()
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
        self.events.emit("ranks_left", attempt=info.round, ranks=left)
        return True

    def _peer_shutdown(self, rdzv: Rendezvous, round_: int) -> bool:
        return any(f.get("kind") == "shutdown" for f in rdzv.failures(round_))

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
            if sent is None and sample.first_step != sample.step:
                # Where this rank resumed, exactly, though sampled after a few steps.
                self.events.emit(
                    "progress",
                    attempt=round_,
                    local_rank=lr,
                    rank=ranks.get(lr),
                    step=sample.first_step,
                    step_time=wall + sample.first_at,
                )
            self._steps_sent[lr] = (sample, now)
            self.events.emit(
                "progress",
                attempt=round_,
                local_rank=lr,
                rank=ranks.get(lr),
                step=sample.step,
                step_time=wall + sample.at,
            )

    def _emit_exits(self, ctx: ProcessContext, round_: int, exited_only: bool = False) -> None:
        for lr, (rank, pid, code, when) in ctx.exit_info().items():
            if lr in self._exits_seen or (exited_only and code is None):
                continue
            self._exits_seen.add(lr)
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
