"""One attempt's workers: starting them, and what is written about them as they run.

`_start` builds each worker's environment (torchrun's, the monitor's, snapshots',
progress', the event log's) and starts them with signals deferred until every pid is
known; the rest is the attempt's bookkeeping while it runs and when it ends:
`worker_exit` and `progress` events, orphans reaped, strays handed to the guardian,
empty stack-dump files removed.
"""

from __future__ import annotations

import time

from stalwart.base import procs
from stalwart.base.events import Event
from stalwart.launch.environment import program_argv, worker_env
from stalwart.launch.errors import signal_name
from stalwart.launch.monitor_sync import job_peers
from stalwart.launch.supervisor_state import SignalReceived, SupervisorState
from stalwart.launch.workers import ProcessContext, WorkerSpecEntry
from stalwart.monitor import envvars as monitor_env
from stalwart.rendezvous import RendezvousInfo
from stalwart.runlog import EVENTS_FILE_ENV

# Progress events a rank writes at most this often (s), besides its first and last.
_PROGRESS_PERIOD = 1.0


class SupervisorAttempt(SupervisorState):
    """Starting an attempt's workers, and its events and leftovers."""

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
        if self._snapshots is not None:
            # No worker of this node runs now: a damaged segment can be replaced.
            for name, problem in self._snapshots.repair():
                self.events.emit(Event.CKPT_RAM_REPAIRED, segment=name, error=problem)
        specs = []
        for lr in range(n):
            env = worker_env(cfg, info, lr, logs[lr])
            env.update(self._worker_key_env)
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
            if self._furthest_step is None or sample.step > self._furthest_step:
                self._furthest_step = sample.step
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
