"""One attempt's workers: starting them, and what is written about them as they run.

`AttemptWorkers` owns the attempt's process context and its bookkeeping.  `start` builds each worker's environment (torchrun's, the monitor's, snapshots',
progress', the event log's) and starts them with signals deferred until every pid is
known; the rest is the attempt's bookkeeping while it runs and when it ends:
`worker_exit` and `progress` events, orphans reaped, strays handed to the guardian,
empty stack-dump files removed.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

from stalwart.base import procs
from stalwart.base.events import Event
from stalwart.config import LaunchConfig
from stalwart.launch.files.logs import LogSpec
from stalwart.launch.round.monitor_sync import job_peers
from stalwart.launch.round.resources import RoundResources
from stalwart.launch.round.signal_gate import SignalGate
from stalwart.launch.workers.environment import program_argv, worker_env
from stalwart.launch.workers.errors import signal_name
from stalwart.launch.workers.processes import ProcessContext, WorkerSpecEntry
from stalwart.monitor import envvars as monitor_env
from stalwart.progress import Sample
from stalwart.rendezvous import RendezvousInfo
from stalwart.runlog import EVENTS_FILE_ENV

# Progress events a rank writes at most this often (s), besides its first and last.
_PROGRESS_PERIOD = 1.0


class AttemptWorkers:
    """The workers of the attempt under way, and what the job ran so far."""

    def __init__(
        self,
        cfg: LaunchConfig,
        res: RoundResources,
        gate: SignalGate,
        emit: Callable[..., object],
        events_path: Path | None,
        logs: LogSpec,
    ) -> None:
        self.cfg = cfg
        self._res = res
        self._gate = gate
        self._emit = emit
        self._events_path = events_path
        self._logs = logs
        self.ctx: ProcessContext | None = None
        self._stacks: list[Path] = []  # this attempt's stack-dump files
        self._exits_seen: set[int] = set()  # local ranks whose worker_exit is written
        self._steps_sent: dict[int, tuple[Sample, float]] = {}  # lr -> (sample, sent at)
        self._tracked: dict[int, float] = {}  # strays handed to the guardian
        #: The furthest step a local rank reported in this attempt (crash-loop policy).
        self.furthest_step: int | None = None
        #: Global ranks this node ran, for the summary.
        self.ranks_run: set[int] = set()

    def start(self, info: RendezvousInfo) -> ProcessContext:
        """A new attempt's workers, started with signals deferred until every pid is
        known; its per-attempt bookkeeping starts afresh."""
        self._exits_seen = set()
        self._steps_sent = {}
        self.furthest_step = None
        if self._res.progress is not None:
            self._res.progress.clear()
        cfg = self.cfg
        n = cfg.nproc_per_node
        ranks = {lr: info.base_rank + lr for lr in range(n)}
        logs = self._logs.make(info.round, n, ranks, cfg.role, info.group_rank)
        adir = self._logs.attempt_dir(info.round)
        # Stack dumps go to the rank's own folder, never to a console shared by ranks.
        stacks = {lr: adir / str(lr) / "stacks.log" for lr in range(n)} if adir else {}
        self._stacks = list(stacks.values())
        program, argv = program_argv(cfg)
        if self._res.snapshots is not None:
            # No worker of this node runs now: a damaged segment can be replaced.
            for name, problem in self._res.snapshots.repair():
                self._emit(Event.CKPT_RAM_REPAIRED, segment=name, error=problem)
        specs = []
        for lr in range(n):
            env = worker_env(cfg, info, lr, logs[lr])
            env.update(self._res.worker_key_env)
            if self._res.hangs is not None:
                env.update(self._res.hangs.worker_env(lr, ranks[lr]))
                if lr in stacks:
                    env[monitor_env.STACKS_FILE] = str(stacks[lr])
            if self._res.snapshots is not None:
                env.update(self._res.snapshots.worker_env())
            if self._res.progress is not None:
                env.update(self._res.progress.worker_env(lr))
            if self._events_path is not None:
                env[EVENTS_FILE_ENV] = str(self._events_path)
            specs.append(WorkerSpecEntry(lr, tuple(argv), env, logs[lr], ranks[lr]))
        ctx = ProcessContext(
            program,
            specs,
            start_method=cfg.start_method,
            run_token=self._res.token,
            guardian=self._res.guardian,
            autoclose=False,
            warm=self._res.warm,
            warm_argv=argv[3:] if self._res.warm is not None else None,
            wait_all=cfg.restart_policy == "all-failed",
            cgroup=self._res.cgroup,
            adopt_orphans=True,
        )
        # A signal that arrives while workers are being started waits until all of them
        # are known, so that each of them gets it forwarded, not a SIGKILL at cleanup.
        self.ctx = ctx
        with self._gate.deferred():
            ctx.start()
        self.ranks_run.update(ranks.values())
        if self._res.hangs is not None:
            dumps = stacks or {lr: p for lr in range(n) if (p := logs[lr].stderr) is not None}
            peers = job_peers(self._res.rdzv, info)
            self._res.hangs.begin(info.round, ctx.pids(), dumps, ranks, peers)
        for lr, pid in ctx.pids().items():
            self._emit(
                Event.WORKER_SPAWN,
                attempt=info.round,
                local_rank=lr,
                rank=ranks[lr],
                worker_pid=pid,
            )
        return ctx

    def reap_orphans(self, ctx: ProcessContext) -> None:
        procs.reap_orphans(set(ctx.pids().values()) | self._res.keep_pids())

    def done(self) -> None:
        """The attempt's workers are stopped and accounted for."""
        self.ctx = None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stops the attempt's workers (the job is stopping: a second signal kills)."""
        self._gate.begin_stopping()
        if self.ctx is not None:
            self.ctx.close(sig, self.cfg.shutdown_timeout)

    def kill_now(self) -> None:
        """No more grace: SIGKILL to every worker's process group."""
        if self.ctx is not None:
            for pid in self.ctx.pids().values():
                procs.killpg_quiet(pid, signal.SIGKILL)

    def track_strays(self, ctx: ProcessContext, attempt: int) -> None:
        """Processes that left the workers' groups are reported once and handed to the
        guardian, which kills them should this process be SIGKILLed.  With a job cgroup
        the guardian kills them anyway; without one, this is the only net for a daemon
        that also cleared its environment."""
        for pid, started in ctx.strays().items():
            if self._tracked.get(pid) == started:
                continue
            self._tracked[pid] = started
            if self._res.guardian is not None:
                self._res.guardian.track(pid, started)
            self._emit(Event.STRAY_PROCESS, attempt=attempt, pid=pid)

    def drop_empty_stacks(self) -> None:
        """Every Python worker opens its stacks.log up front (a signal handler cannot);
        the ones no hang wrote to are not left behind."""
        for path in self._stacks:
            try:
                if path.stat().st_size == 0:
                    path.unlink()
            except FileNotFoundError:
                pass

    def emit_progress(self, round_: int, ranks: dict[int, int], final: bool) -> None:
        """A ``progress`` event per rank when its step moved: the first step of an
        attempt at once, then at most one a second, and the last one at the end."""
        if self._res.progress is None:
            return
        now = time.monotonic()
        for lr, sample in self._res.progress.read().items():
            if self.furthest_step is None or sample.step > self.furthest_step:
                self.furthest_step = sample.step
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
                self._emit(
                    Event.PROGRESS,
                    attempt=round_,
                    local_rank=lr,
                    rank=ranks.get(lr),
                    step=step,
                    step_time=wall + at,
                )

    def emit_exits(self, ctx: ProcessContext, round_: int, exited_only: bool = False) -> None:
        for lr, (rank, pid, code, when) in ctx.exit_info().items():
            if lr in self._exits_seen or (exited_only and code is None):
                continue
            self._exits_seen.add(lr)
            self._emit(
                Event.WORKER_EXIT,
                attempt=round_,
                local_rank=lr,
                rank=rank,
                worker_pid=pid,
                exitcode=code,
                signal=signal_name(code),
                exited_at=when,
            )
