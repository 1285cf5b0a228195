"""How a wrapped call ends on one rank: leaving early, finishing, and the store host
serving peers that still need it.  ``runner.Runner`` inherits it; the fields it reads
are the runner's, declared here.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time

from .abort import destroy_process_groups
from .groups import GroupKeeper
from .iteration_stores import IterationStores
from .monitor_process import MonitorProcess
from .options import Options
from .progress import Periodic
from .state import Interruption, InterruptionRecord, State
from .store import CoordStore

log = logging.getLogger("stalwart.inprocess.runner")


class RunnerEnding:
    """The ending half of `Runner` (see the module doc)."""

    opts: Options
    state: State
    coord: CoordStore
    is_host: bool
    groups: GroupKeeper
    iteration_stores: IterationStores
    monitor_process: MonitorProcess
    ticker: Periodic
    heartbeat: Periodic
    _saved_env: dict[str, str | None]

    def _close(self) -> None:
        raise NotImplementedError  # Runner's: runs its cleanup steps

    # -- leaving -----------------------------------------------------------------------
    def _leave_abnormally(self, state: State, exc: BaseException) -> None:
        """Mark this rank terminated so survivors do not wait for its heartbeat to stop."""
        log.error(
            "initial rank %d leaves the job: %s: %s", state.initial_rank, type(exc).__name__, exc
        )
        with contextlib.suppress(Exception):
            destroy_process_groups()
        if self.is_host:
            # Before the record that lets peers pass the termination barrier, so
            # their next iteration's env:// store is there when they look.
            with contextlib.suppress(Exception):
                self._serve_port(state.iteration + 1)
        with contextlib.suppress(Exception):
            self.coord.record_terminated(state.initial_rank, type(exc).__name__)
            self.coord.record_interruption(
                InterruptionRecord(
                    state.initial_rank,
                    state.iteration,
                    Interruption.BASE_EXCEPTION,
                    f"{type(exc).__name__}: {exc}",
                )
            )

    def _finish(self, clean: bool) -> None:
        # Stop the background threads before announcing the exit: once peers
        # see "left", the store host may go, and a heartbeat caught mid-call
        # on a vanished store would stall this exit long enough for the
        # monitor process to take it for a hang.  A host leaving early keeps
        # beating while it serves the others.
        if clean or not self.is_host:
            self._stop_background()
        if clean:
            with contextlib.suppress(Exception):
                self.coord.record_left()
        if self.is_host:
            self._keep_store_until_peers_leave(clean)
        self._stop_background()
        self.groups.release()
        self._close()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        gc.collect()

    def _stop_background(self) -> None:
        self.monitor_process.stop()
        self.ticker.stop()
        self.heartbeat.stop()

    def _keep_store_until_peers_leave(self, clean: bool) -> None:
        """The store lives in this process: peers still need it to finish.

        After a completed job peers only have to read the completion barrier
        and record leaving, so ``last_call_wait`` bounds the wait.  When this
        rank leaves early (health check, hook error) the others go on training
        through this store: it stays up until each has left or stopped beating.
        """
        coord = self.coord
        deadline = time.monotonic() + self.opts.last_call_wait if clean else None
        pending = [r for r in range(self.state.initial_world_size) if r != self.state.initial_rank]
        # Having left early, this rank still serves each later iteration's env:// store.
        next_iteration = self.state.iteration + 2
        while pending and (deadline is None or time.monotonic() < deadline):
            try:
                pending = [r for r in pending if not (coord.has_left(r) or coord.is_gone(r))]
                if not clean and coord.fault(next_iteration - 1) is not None:
                    self._serve_port(next_iteration)
                    next_iteration += 1
            except Exception:
                return
            if pending:
                time.sleep(0.01 if clean else 0.005)
        if pending:
            log.warning("store host stops waiting for ranks %s to leave", pending)

    def _serve_port(self, iteration: int) -> None:
        if self.coord.port(iteration) is None:
            self.iteration_stores.close_before(iteration - 1)
            self.coord.publish_port(iteration, self.iteration_stores.open(iteration))

    def _log_interruptions(self, state: State) -> None:
        """One summary per restart, on the store host: who interrupted and why."""
        try:
            records = self.coord.interruptions(state.iteration, range(state.initial_world_size))
        except Exception:
            return
        for rec in records:
            log.info(
                "iteration %d interrupted by initial rank %d: %s %s",
                rec.iteration,
                rec.rank,
                rec.kind.value,
                rec.message[:300],
            )
