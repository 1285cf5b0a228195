"""One node's supervisor: rendezvous -> start workers -> watch -> restart | finish | fail.

The supervisor owns the life of a job on its node.  Each round it joins the rendezvous
(job-wide round number = attempt = ``TORCHELASTIC_RESTART_COUNT``), starts the local
workers with torchrun's environment, and watches three things: its own workers (woken
by their exit through pidfds), the other nodes (a failure flag in the store) and the
hang monitor.  Any failure stops every local worker; the job restarts while the budget
lasts, else the root cause is printed and the launcher exits non-zero.  Every state
change goes to ``events.jsonl``.

This module holds the loop (join -> run the round -> decide -> act) and the round's
watch; the other concerns are parts the `Supervisor` owns and wires together, each with
its own state: `SignalGate` (signal_gate: handlers and the stopping flag),
`RoundResources` (resources: made once, one ordered close), `AttemptWorkers` (attempt:
the attempt's workers and their events) and `JobEnding` (ending: acting on a move, the
result, the closing block); the records they pass are in records.
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
from pathlib import Path

import msgspec
import psutil

from stalwart.base.events import Event
from stalwart.config import ConfigError, LaunchConfig
from stalwart.health.records import By
from stalwart.launch.files.events import EventLog, EventTail
from stalwart.launch.files.logs import LogSpec
from stalwart.launch.files.runfiles import check_component, make_run_dir
from stalwart.launch.round.attempt import AttemptWorkers
from stalwart.launch.round.decide import (
    Asked,
    ControlAsk,
    RoundOutcome,
    RoundView,
    Stop,
    control_outcome,
    control_reason,
    decide,
    grows,
    interrupted,
    not_needed,
    quarantined,
    stop_grace,
)
from stalwart.launch.round.ending import JobEnding
from stalwart.launch.round.records import JobResult, SignalReceived
from stalwart.launch.round.resources import RoundResources
from stalwart.launch.round.restart_policy import AttemptEnd, LoopPolicy, Verdict, cause_of, verdict
from stalwart.launch.round.signal_gate import SignalGate
from stalwart.launch.workers.failures import root_cause
from stalwart.launch.workers.processes import RunResult
from stalwart.monitor import ControlRequest
from stalwart.rendezvous import (
    FailureRecord,
    JobEnded,
    NodeExcluded,
    NodesWaiting,
    Rendezvous,
    RendezvousError,
    RendezvousInfo,
    ShutdownRequested,
    StoreLost,
    membership_change,
)
from stalwart.reporting.metrics import MetricsPortError, MetricsServer

logger = logging.getLogger(__name__)

# Seconds between reaping orphans, and between scans for strays to hand to the guardian:
# often without a job cgroup (the guardian's only way to find them after a SIGKILL),
# rarely with one (the cgroup holds them all; the scan only reports them).  A scan reads
# the whole process table.
_REAP_EVERY = 1.0
_STRAY_SCAN = 0.5
_STRAY_SCAN_WITH_CGROUP = 5.0


class Supervisor:
    """Runs one node's share of a job to completion: the run's record (folder, event log,
    logs, metrics) and the loop, over the parts it owns."""

    def __init__(self, cfg: LaunchConfig, rendezvous: Rendezvous | None = None) -> None:
        self.cfg = cfg
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
        self._gate = SignalGate(on_second=self._no_more_grace)
        self._res = RoundResources(cfg, self.events.emit, self.run_dir, rendezvous)
        self._attempt = AttemptWorkers(
            cfg, self._res, self._gate, self.events.emit, self.events.path, self.logs
        )
        self._ending = JobEnding(
            cfg, self.events, self.run_dir, lambda: self._res.rdzv, self._attempt.ranks_run
        )
        self._round = 0  # the attempt under way, for events written on a signal
        self._reason = ""  # why a rank's control request ended the round
        self._folder_shown = False
        # The crash-loop policy's inputs: the job's failed attempts and checkpoint commits
        # from the event log (from where this run starts: a reused run folder holds
        # earlier runs' commits).
        self._failed_attempts: list[AttemptEnd] = []
        self._commits = EventTail(self.events.path, self.events.start_offset)

    def prestart(self) -> None:
        """Starts the guardian and the warm template; cheap, and torch-free, so a caller
        can do it before anything imports torch in the launcher (``run`` does it too)."""
        self._res.prestart()

    def _no_more_grace(self) -> None:
        """A second signal while stopping."""
        self._attempt.kill_now()
        if self._res.rdzv is not None:
            self._res.rdzv.interrupt()  # an excluded store host stops serving

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> JobResult:
        cfg = self.cfg
        self.events.emit(
            Event.LAUNCHER_START,
            # The process began before this record (interpreter, imports, settings, the
            # template's start): the run's accounting starts there.
            process_start=round(psutil.Process().create_time(), 3),
            nnodes=cfg.nnodes,
            nproc_per_node=cfg.nproc_per_node,
            max_restarts=cfg.max_restarts,
            entrypoint=cfg.entrypoint,
            args=cfg.args,
            run_dir=str(self.run_dir) if self.run_dir else None,
            inject=cfg.inject or None,
        )
        with contextlib.ExitStack() as teardown:
            # In reverse: each runs whatever an earlier one raised, so a store that is
            # gone must not leave the workers, the monitor or the guardian behind.
            teardown.callback(self._gate.restore)
            if self._metrics is not None:
                teardown.callback(self._metrics.close)
            teardown.callback(self.events.close)
            teardown.callback(self._ending.write_exit)
            teardown.callback(self._res.close)
            teardown.callback(self._attempt.stop)
            teardown.callback(self._res.quiesce)
            try:
                self._gate.install(cfg.signals_to_handle)
                result = self._loop(self._set_up())
            except SignalReceived as sig:
                result = self._interrupted(sig.sig)
            except RendezvousError as err:
                # The CLI reports it in one line and exits 3; the event log says the same.
                self.events.emit(Event.RENDEZVOUS_ERROR, error=str(err))
                self._ending.rdzv_failed = True
                rdzv = self._res.rdzv
                if rdzv is not None and not isinstance(err, StoreLost):
                    # The job cannot form (e.g. too few nodes): spares waiting stop too.
                    rdzv.finish(False, str(err))
                raise
            return result

    def _set_up(self) -> Rendezvous:
        return self._res.set_up()

    def _interrupted(self, sig: int) -> JobResult:
        self._gate.begin_stopping()
        name = signal.Signals(sig).name
        logger.warning(
            "received %s: stopping workers (grace %.1fs)", name, self.cfg.shutdown_timeout
        )
        self.events.emit(Event.SHUTDOWN, signal=name, grace=self.cfg.shutdown_timeout)
        ctx = self._attempt.ctx
        if ctx is not None:
            self._attempt.stop(sig)
            self._attempt.drop_empty_stacks()
            self._attempt.emit_exits(ctx, self._round)
        return self._ending.stop(interrupted(sig, self._round))

    def _loop(self, rdzv: Rendezvous) -> JobResult:
        """join -> run the round -> decide -> act, until a move stops the job."""
        attempt = 0
        while True:
            guard = self._res.quarantine
            gate = self._res.health
            # The one question before a round: may this node join it at all?
            refusal = gate.before_round(rdzv, attempt) if gate is not None else None
            if refusal is not None and refusal.by is By.QUARANTINE:
                return self._ending.stop(quarantined(refusal.line, refusal.goes_on, attempt))
            if refusal is not None:
                # One node (validated): no round to close without it, so the job ends.
                raise RendezvousError(refusal.line)
            try:
                info = self._join(rdzv, attempt)
            except JobEnded as ended:
                return self._ending.stop(not_needed(ended.succeeded, ended.reason, ended.exit_code))
            if self._res.replicas is not None:
                self._res.replicas.begin_round(
                    info.round,
                    info.group_rank,
                    info.group_world_size,
                    info.base_rank,
                    info.world_size,
                )
            outcome, result = self._run_round(rdzv, info)
            records = rdzv.failures(info.round) if outcome is not RoundOutcome.SUCCEEDED else []
            fresh = (
                guard.record(rdzv, info.round, info.group_rank, records)
                if records and guard is not None
                else ()
            )
            loop = None
            failed = outcome in (RoundOutcome.LOCAL_FAILURE, RoundOutcome.PEER_FAILURE)
            if failed and not membership_change(records):  # a grow fails nothing
                loop = self._judge_loop(info.round, records)
            if fresh:
                # Not a crash loop yet: the next round runs without the quarantined node.
                loop = None
            view = RoundView(
                outcome, info.round, self.cfg.max_restarts, tuple(records), self._reason, loop
            )
            move = decide(view)
            if isinstance(move, Stop):
                return self._ending.stop(move, result)
            self._ending.restart(move, result)
            attempt = move.next_attempt

    def _judge_loop(self, round_: int, records: list[FailureRecord]) -> Verdict | None:
        """Adds the failed attempt to the job's and asks the crash-loop policy whether a
        restart can still help."""
        checkpoint: int | None = None
        for ev in self._commits.read():
            step = ev.get("step")
            if ev.get("event") == Event.CHECKPOINT_COMMIT and type(step) is int and step >= 0:
                checkpoint = step if checkpoint is None else max(checkpoint, step)
        end = AttemptEnd(round_, cause_of(records), self._attempt.furthest_step, checkpoint)
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
        attempt, hangs = self._attempt, self._res.hangs
        ctx = attempt.start(info)
        ranks = {lr: info.base_rank + lr for lr in range(cfg.nproc_per_node)}
        outcome: RoundOutcome | None = None
        result: RunResult | None = None
        last_reap = last_scan = time.monotonic()
        scan_every = _STRAY_SCAN if self._res.cgroup is None else _STRAY_SCAN_WITH_CGROUP
        while outcome is None:
            result = ctx.wait(timeout=cfg.monitor_interval, period=cfg.monitor_interval)
            self._gate.raise_swallowed()
            if hangs is not None:
                hangs.collect()
            # Written as the exit is seen, not after the attempt's teardown.
            attempt.emit_exits(ctx, info.round, exited_only=True)
            attempt.emit_progress(info.round, ranks, final=False)
            if result is not None:
                if result.is_failed() and self._completed_without(result, info):
                    outcome = self._await_peers(rdzv, info.round)
                elif result.is_failed():
                    outcome = RoundOutcome.LOCAL_FAILURE
                    result.failures = {
                        lr: msgspec.structs.replace(f, node_rank=info.group_rank)
                        for lr, f in result.failures.items()
                    }
                    if hangs is not None:
                        hangs.count_hung_roots(result.failures, info.group_rank)
                        hangs.explain(result.failures)
                    rdzv.report_failure(info.round, root_cause(list(result.failures.values())))
                else:
                    outcome = self._await_peers(rdzv, info.round)
            elif rdzv.failed(info.round):
                outcome = RoundOutcome.PEER_FAILURE
                self.events.emit(Event.PEER_FAILURE, attempt=info.round)
            elif hangs is not None and (req := hangs.control_request(info.round)):
                outcome = self._on_request(rdzv, info, req)
            elif grows(rdzv.elastic, n := rdzv.waiting(info.round), info.round, cfg.max_restarts):
                outcome = self._grow(rdzv, info, n)
            # Upkeep only while the round goes on: a round that ends stops its workers
            # first (the teardown kills strays and reaps orphans itself), so a death is
            # not kept waiting on a pass over the process table.
            if outcome is None and time.monotonic() - last_reap > _REAP_EVERY:
                attempt.reap_orphans(ctx)
                last_reap = time.monotonic()
            if outcome is None and time.monotonic() - last_scan > scan_every:
                attempt.track_strays(ctx, info.round)
                last_scan = time.monotonic()
        attempt.emit_progress(info.round, ranks, final=True)
        grace = stop_grace(outcome, cfg.shutdown_timeout, cfg.survivor_grace)
        self.events.emit(
            Event.WORKERS_STOPPING, attempt=info.round, reason=outcome.value, grace=grace
        )
        if hangs is not None:
            hangs.end()
        ctx.close(signal.SIGTERM, grace)
        attempt.drop_empty_stacks()
        if outcome is RoundOutcome.LOCAL_FAILURE and result is not None:
            self._explain_late(rdzv, info.round, result, info.group_rank)
        attempt.emit_exits(ctx, info.round)
        attempt.reap_orphans(ctx)
        attempt.done()
        return outcome, result

    def _explain_late(
        self, rdzv: Rendezvous, round_: int, result: RunResult, node_rank: int
    ) -> None:
        """A hang report filed after the death was acted on (the teardown did not wait for
        it) still names the hang in this node's failure record, hence in the summary."""
        hangs = self._res.hangs
        if hangs is None:
            return
        added = hangs.count_hung_roots(result.failures, node_rank)
        if result.failures and (hangs.explain(result.failures) or added):
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

    def _grow(self, rdzv: Rendezvous, info: RendezvousInfo, waiting: int) -> RoundOutcome:
        """Ends the round so that the next one admits the waiting nodes, as torchrun's
        agent restarts its workers when nodes wait; every node restarts its workers with
        the larger world (and the program reshards from its checkpoint)."""
        logger.warning(
            "attempt %d: %d node(s) waiting to join; restarting the workers to admit them",
            info.round,
            waiting,
        )
        self.events.emit(Event.NODES_WAITING, attempt=info.round, waiting=waiting)
        reason = f"{waiting} node(s) waiting to join a job of {info.group_world_size}"
        rdzv.report_failure(
            info.round,
            NodesWaiting(
                node_rank=info.group_rank,
                host=socket.gethostname(),
                reason=reason,
                waiting=waiting,
            ),
        )
        return RoundOutcome.NODES_WAITING

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
