"""One node's supervisor: rendezvous -> start workers -> watch -> restart | finish | fail.

The supervisor owns the life of a job on its node.  Each round it joins the rendezvous
(job-wide round number = attempt = ``TORCHELASTIC_RESTART_COUNT``), starts the local
workers with torchrun's environment, and watches three things: its own workers (woken
by their exit through pidfds), the other nodes (a failure flag in the store) and the
hang monitor.  Any failure stops every local worker; the job restarts while the budget
lasts, else the root cause is printed and the launcher exits non-zero.  Every state
change goes to ``events.jsonl``.

This module holds the loop (join -> run the round -> decide -> act) and the round's
watch; the other concerns are parts of their own, put together here:
`supervisor_state` (fields, records), `supervisor_resources` (made once, closed at the
end), `supervisor_attempt` (workers and their events), `supervisor_ending` (acting on a
move, the closing block).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType

import msgspec

from stalwart.base import procs
from stalwart.base.events import Event
from stalwart.launch import signals
from stalwart.launch.decide import (
    Asked,
    ControlAsk,
    RoundOutcome,
    RoundView,
    Stop,
    control_outcome,
    control_reason,
    decide,
    interrupted,
    not_needed,
    quarantined,
)
from stalwart.launch.failures import root_cause
from stalwart.launch.restart_policy import AttemptEnd, LoopPolicy, Verdict, cause_of, verdict
from stalwart.launch.supervisor_attempt import SupervisorAttempt
from stalwart.launch.supervisor_ending import SupervisorEnding
from stalwart.launch.supervisor_resources import SupervisorResources
from stalwart.launch.supervisor_state import JobResult, SignalReceived
from stalwart.launch.workers import RunResult
from stalwart.monitor import ControlRequest
from stalwart.rendezvous import (
    FailureRecord,
    JobEnded,
    NodeExcluded,
    Rendezvous,
    RendezvousError,
    RendezvousInfo,
    ShutdownRequested,
    StoreLost,
)

logger = logging.getLogger(__name__)

_FORWARDED = signals.FORWARDED
# Seconds between reaping orphans, and between scans for strays to hand to the guardian:
# often without a job cgroup (the guardian's only way to find them after a SIGKILL),
# rarely with one (the cgroup holds them all; the scan only reports them).  A scan reads
# the whole process table.
_REAP_EVERY = 1.0
_STRAY_SCAN = 0.5
_STRAY_SCAN_WITH_CGROUP = 5.0


class Supervisor(SupervisorResources, SupervisorAttempt, SupervisorEnding):
    """Runs one node's share of a job to completion."""

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
        if self._signal_seen is None:
            self._signal_seen = signum
        raise SignalReceived(signum)

    def _act_on_swallowed_signal(self) -> None:
        """A signal whose exception something caught and dropped is acted on here."""
        if self._signal_seen is not None and not self._stopping:
            raise SignalReceived(self._signal_seen)

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
            if self._quarantine is not None and (kept := self._quarantine.check(rdzv, attempt)):
                return self._stop(
                    quarantined(kept.withdrawal.line, kept.withdrawal.goes_on, attempt)
                )
            try:
                info = self._join(rdzv, attempt)
            except JobEnded as ended:
                return self._stop(not_needed(ended.succeeded, ended.reason, ended.exit_code))
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
            fresh = (
                self._quarantine.record(rdzv, info.round, info.group_rank, records)
                if records and self._quarantine is not None
                else ()
            )
            loop = None
            if outcome in (RoundOutcome.LOCAL_FAILURE, RoundOutcome.PEER_FAILURE):
                loop = self._judge_loop(info.round, records)
            if fresh:
                # Not a crash loop yet: the next round runs without the quarantined node.
                loop = None
            view = RoundView(
                outcome, info.round, self.cfg.max_restarts, tuple(records), self._reason, loop
            )
            move = decide(view)
            if isinstance(move, Stop):
                return self._stop(move, result)
            self._restart(move, result)
            attempt = move.next_attempt

    def _judge_loop(self, round_: int, records: list[FailureRecord]) -> Verdict | None:
        """Adds the failed attempt to the job's and asks the crash-loop policy whether a
        restart can still help."""
        checkpoint: int | None = None
        for ev in self._commits.read():
            step = ev.get("step")
            if ev.get("event") == Event.CHECKPOINT_COMMIT and type(step) is int and step >= 0:
                checkpoint = step if checkpoint is None else max(checkpoint, step)
        end = AttemptEnd(round_, cause_of(records), self._furthest_step, checkpoint)
        self._failed_attempts.append(end)
        cfg = self.cfg
        policy = LoopPolicy(cfg.max_no_progress_attempts, cfg.stop_on, cfg.no_requeue_exit_code)
        return verdict(self._failed_attempts, policy)

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

    def _run_round(
        self, rdzv: Rendezvous, info: RendezvousInfo
    ) -> tuple[RoundOutcome, RunResult | None]:
        cfg = self.cfg
        self._exits_seen = set()
        self._steps_sent = {}
        self._furthest_step = None
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
            self._act_on_swallowed_signal()
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
                    result.failures = {
                        lr: msgspec.structs.replace(f, node_rank=info.group_rank)
                        for lr, f in result.failures.items()
                    }
                    if self._hangs is not None:
                        self._hangs.count_hung_roots(result.failures, info.group_rank)
                        self._hangs.explain(result.failures)
                    rdzv.report_failure(info.round, root_cause(list(result.failures.values())))
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
            self._explain_late(rdzv, info.round, result, info.group_rank)
        self._emit_exits(ctx, info.round)
        self._reap_orphans(ctx)
        self._ctx = None
        return outcome, result

    def _explain_late(
        self, rdzv: Rendezvous, round_: int, result: RunResult, node_rank: int
    ) -> None:
        """A hang report filed after the death was acted on (the teardown did not wait for
        it) still names the hang in this node's failure record, hence in the summary."""
        if self._hangs is None:
            return
        added = self._hangs.count_hung_roots(result.failures, node_rank)
        if result.failures and (self._hangs.explain(result.failures) or added):
            rdzv.report_failure(round_, root_cause(list(result.failures.values())))

    def _on_request(
        self, rdzv: Rendezvous, info: RendezvousInfo, req: ControlRequest
    ) -> RoundOutcome | None:
        ask = ControlAsk(Asked(req.action.value), req.global_rank, req.reason)
        outcome = control_outcome(ask.action, rdzv.elastic)
        if outcome is None:
            return None
        self._reason = reason = control_reason(ask, outcome, info.group_rank, socket.gethostname())
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
