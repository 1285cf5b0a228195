"""How a round or the job ends on this node: events, console lines, the closing block.

`JobEnding.restart` and `.stop` act on `decide`'s move (events, the warning or the
failure summary on the console, the other nodes told); `stop` is the one place a
`JobResult` is made, and the ending keeps it.  `write_exit` writes `launcher_exit` with
the closing figures (`_end_report`: goodput, faults that never fired).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stalwart.base.events import Event
from stalwart.base.records import clip, printable
from stalwart.config import LaunchConfig
from stalwart.launch.files.events import EventLog
from stalwart.launch.round.decide import (
    Ending,
    Restart,
    Stop,
)
from stalwart.launch.round.records import JobResult
from stalwart.launch.workers.failures import (
    describe_exit,
    failure_fields,
    format_summary,
    root_cause,
)
from stalwart.launch.workers.processes import RunResult
from stalwart.rendezvous import (
    NodeExcluded,
    NodeLost,
    Rendezvous,
    WorkerFailed,
)
from stalwart.reporting.read import read_events
from stalwart.reporting.summary import end_block, never_fired

logger = logging.getLogger(__name__)


class JobEnding:
    """Acting on the end of a round or of the job; holds the job's result once made."""

    def __init__(
        self,
        cfg: LaunchConfig,
        events: EventLog,
        run_dir: Path | None,
        rendezvous: Callable[[], Rendezvous | None],
        ranks_run: set[int],
    ) -> None:
        self.cfg = cfg
        self._events = events
        self._run_dir = run_dir
        # The rendezvous is made after this part (from the configuration, in set_up).
        self._rendezvous = rendezvous
        self._ranks_run = ranks_run
        self.result: JobResult | None = None
        #: The job could not form: the launcher exits 3.
        self.rdzv_failed = False

    # -- acting on a move --------------------------------------------------------------
    def _failures(
        self, workers: tuple[WorkerFailed, ...], result: RunResult | None
    ) -> list[WorkerFailed]:
        """The failed workers every node reported, else this node's own."""
        if workers or result is None:
            return list(workers)
        return list(result.failures.values())

    def _emit_departed(self, departed: tuple[NodeLost | NodeExcluded, ...], attempt: int) -> None:
        for gone in departed:
            self._events.emit(
                Event.NODE_LOST if isinstance(gone, NodeLost) else Event.NODE_EXCLUDED,
                attempt=attempt,
                lost_node_rank=gone.node_rank,
                lost_host=gone.host,
                reason=gone.reason,
            )
            logger.warning("attempt %d: %s", attempt, gone.reason)

    def restart(self, move: Restart, result: RunResult | None) -> None:
        self._emit_departed(move.departed, move.attempt)
        failures = self._failures(move.workers, result)
        cause = root_cause(failures) if failures else None
        self._events.emit(
            Event.RESTART,
            attempt=move.attempt,
            next_attempt=move.next_attempt,
            reason=move.reason,
            root_cause=failure_fields(cause) if cause else None,
            restarts_left=move.restarts_left,
        )
        if cause is not None:
            logger.warning(
                "attempt %d failed: rank %s %s%s; restarting (%d of %d)",
                move.attempt,
                cause.rank,
                describe_exit(cause),
                f" ({printable(clip(cause.reason or cause.message, 200))})"
                if cause.reason or cause.message
                else "",
                move.next_attempt,
                self.cfg.max_restarts,
            )

    def stop(self, move: Stop, result: RunResult | None = None) -> JobResult:
        """Says how the job ended on this node (events, console, the other nodes) and
        makes the ``JobResult``: the one place one is made."""
        cfg = self.cfg
        attempt = move.attempts - 1
        self._emit_departed(move.departed, attempt)
        gave_up = move.ending in (Ending.GAVE_UP, Ending.CRASH_LOOP)
        failures = self._failures(move.workers, result) if gave_up else []
        match move.ending:
            case Ending.SUCCEEDED:
                self._events.emit(Event.JOB_SUCCEEDED, attempt=attempt)
            case Ending.GAVE_UP | Ending.CRASH_LOOP:
                cause = root_cause(failures) if failures else None
                verdict = {"verdict": move.reason} if move.ending is Ending.CRASH_LOOP else {}
                self._events.emit(
                    Event.JOB_FAILED,
                    attempt=attempt,
                    root_cause=failure_fields(cause) if cause else None,
                    **verdict,
                )
            case Ending.SHUT_DOWN | Ending.INTERRUPTED:
                self._events.emit(Event.JOB_STOPPED, attempt=attempt, reason=move.reason)
            case Ending.EXCLUDED:
                self._events.emit(Event.NODE_EXCLUDED, attempt=attempt, reason=move.reason)
            case Ending.QUARANTINED if move.tell is None:
                self._events.emit(Event.NODE_EXCLUDED, attempt=attempt, reason=move.reason)
            case Ending.QUARANTINED:
                self._events.emit(Event.JOB_STOPPED, attempt=attempt, reason=move.reason)
            case Ending.NOT_NEEDED:
                self._events.emit(Event.JOB_ENDED_WITHOUT_THIS_NODE, reason=move.reason)
        rdzv = self._rendezvous()
        if move.tell is not None and rdzv is not None:
            rdzv.finish(move.tell.succeeded, move.tell.reason, move.tell.exit_code)
        line = ""
        match move.ending:
            case Ending.GAVE_UP | Ending.CRASH_LOOP if failures:
                line = format_summary(
                    failures,
                    run_id=cfg.run_id,
                    attempts=move.attempts,
                    log_dir=str(self._run_dir) if self._run_dir else None,
                )
                if move.ending is Ending.CRASH_LOOP:
                    line += f"\nstalwart: {move.reason}"
            case Ending.CRASH_LOOP:
                line = f"stalwart: job {cfg.run_id} {move.reason}"
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
            case Ending.QUARANTINED if move.tell is None:
                line = (
                    f"stalwart: this node left job {cfg.run_id} after attempt {attempt}: "
                    f"{move.reason}"
                )
            case Ending.QUARANTINED:
                line = f"stalwart: job {cfg.run_id} stopped after attempt {attempt}: {move.reason}"
            case Ending.NOT_NEEDED if move.exit_code not in (0, 1):
                # A peer stopped a crash loop while this node was joining the next round.
                line = f"stalwart: job {cfg.run_id} stopped by another node: {move.reason}"
            case Ending.NOT_NEEDED:
                line = f"stalwart: job {cfg.run_id} ended without needing this node ({move.reason})"
        if line:
            print(line, file=sys.stderr, flush=True)
        succeeded = move.ending is Ending.SUCCEEDED
        self.result = JobResult(
            exit_code=move.exit_code,
            state=move.state,
            attempts=move.attempts,
            failures=failures,
            return_values=result.return_values if succeeded and result is not None else {},
            run_dir=self._run_dir,
        )
        return self.result

    def write_exit(self) -> None:
        result = self.result
        code = result.exit_code if result is not None else (3 if self.rdzv_failed else 1)
        closing: dict[str, Any] = {}
        if result is not None and result.attempts > 0:  # not a spare never admitted
            closing = self._end_report(result)
        # The closing figures ride on launcher_exit: the job's last events stay
        # job_succeeded | job_failed | job_stopped, then launcher_exit.
        self._events.emit(Event.LAUNCHER_EXIT, exit_code=code, **closing)

    def _end_report(self, result: JobResult) -> dict[str, Any]:
        """The job's closing block on the console, and faults that never fired; returns
        the fields for ``launcher_exit`` (``goodput``, ``inject_not_fired``)."""
        path = self._events.path
        if path is None or not path.is_file():
            return {}
        fields: dict[str, Any] = {}
        try:
            # This run only: a reused run folder keeps earlier runs' events before it.
            events = list(read_events(path, start=self._events.start_offset))
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
                run_dir=str(self._run_dir) if self._run_dir else None,
            )
        except (OSError, ValueError, KeyError, TypeError) as err:
            # A summary must never turn a finished job into a failed launcher.
            logger.warning("could not summarise the run: %s", err)
            return fields
        fields["goodput"] = {**breakdown.seconds, "ratio": breakdown.goodput}
        print(block, file=sys.stderr, flush=True)
        return fields
