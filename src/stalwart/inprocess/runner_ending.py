"""How a wrapped call ends on one rank: leaving early, finishing, and the store host
serving peers that still need it.

`Ending` is given what it acts on (the store client, the iteration stores, the group
keeper, the background threads to stop) and the rank's `State` at each call; the
runner's own cleanup steps stay the runner's, run after `Ending.finish`.  How long the
store host waits, and which peers it still waits for, are pure functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from .abort import destroy_process_groups
from .groups import GroupKeeper
from .iteration_stores import IterationStores
from .runner_faults import interruption_record
from .state import State
from .store import CoordStore

# The runner's logger: users filter on it, whichever part speaks.
log = logging.getLogger("stalwart.inprocess.runner")


class Stoppable(Protocol):
    def stop(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class HostWait:
    """How the store host waits for its peers to leave."""

    deadline: float | None  # monotonic; None: until each peer has left or is gone
    poll: float  # seconds between looks


def host_wait(clean: bool, last_call_wait: float, now: float) -> HostWait:
    """After a completed job peers only read the completion barrier and record leaving,
    so ``last_call_wait`` bounds the wait; a host leaving early keeps serving the others
    for as long as they train."""
    if clean:
        return HostWait(deadline=now + last_call_wait, poll=0.01)
    return HostWait(deadline=None, poll=0.005)


def stops_background_first(clean: bool, is_host: bool) -> bool:
    """Stop the background threads before announcing the exit: once peers see "left",
    the store host may go, and a heartbeat caught mid-call on a vanished store would
    stall this exit long enough for the monitor process to take it for a hang.  A host
    leaving early keeps beating while it serves the others."""
    return clean or not is_host


def still_pending(pending: Iterable[int], done: Callable[[int], bool]) -> list[int]:
    """The peers of ``pending`` (in order) that have neither left nor gone."""
    return [r for r in pending if not done(r)]


class Ending:
    """Leaving early and finishing, for one rank (see the module doc)."""

    def __init__(
        self,
        coord: CoordStore,
        is_host: bool,
        iteration_stores: IterationStores,
        groups: GroupKeeper,
        background: Sequence[Stoppable],
        last_call_wait: float,
    ) -> None:
        self._coord = coord
        self._is_host = is_host
        self._iteration_stores = iteration_stores
        self._groups = groups
        self._background = tuple(background)
        self._last_call_wait = last_call_wait

    def leave_abnormally(self, state: State, exc: BaseException) -> None:
        """Mark this rank terminated so survivors do not wait for its heartbeat to stop."""
        log.error(
            "initial rank %d leaves the job: %s: %s", state.initial_rank, type(exc).__name__, exc
        )
        with contextlib.suppress(Exception):
            destroy_process_groups()
        if self._is_host:
            # Before the record that lets peers pass the termination barrier, so
            # their next iteration's env:// store is there when they look.
            with contextlib.suppress(Exception):
                self.serve_port(state.iteration + 1)
        with contextlib.suppress(Exception):
            self._coord.record_terminated(state.initial_rank, type(exc).__name__)
            self._coord.record_interruption(interruption_record(state, exc, leaving=True))

    def finish(self, state: State, clean: bool) -> None:
        """Announce leaving (if ``clean``), hold the store for peers (on the host), stop
        the background threads and release the groups; the caller closes the rest."""
        if stops_background_first(clean, self._is_host):
            self.stop_background()
        if clean:
            with contextlib.suppress(Exception):
                self._coord.record_left()
        if self._is_host:
            self._keep_store_until_peers_leave(state, clean)
        self.stop_background()
        self._groups.release()

    def stop_background(self) -> None:
        for part in self._background:
            part.stop()

    def _keep_store_until_peers_leave(self, state: State, clean: bool) -> None:
        """The store lives in this process: peers still need it to finish (see
        `host_wait`); having left early, it also serves each later iteration's
        env:// store."""
        coord = self._coord
        wait = host_wait(clean, self._last_call_wait, time.monotonic())
        pending = [r for r in range(state.initial_world_size) if r != state.initial_rank]
        next_iteration = state.iteration + 2
        while pending and (wait.deadline is None or time.monotonic() < wait.deadline):
            try:
                pending = still_pending(pending, lambda r: coord.has_left(r) or coord.is_gone(r))
                if not clean and coord.fault(next_iteration - 1) is not None:
                    self.serve_port(next_iteration)
                    next_iteration += 1
            except Exception:
                return
            if pending:
                time.sleep(wait.poll)
        if pending:
            log.warning("store host stops waiting for ranks %s to leave", pending)

    def serve_port(self, iteration: int) -> None:
        """Open and publish ``iteration``'s env:// store unless it is published."""
        if self._coord.port(iteration) is None:
            self._iteration_stores.close_before(iteration - 1)
            self._coord.publish_port(iteration, self._iteration_stores.open(iteration))

    def log_interruptions(self, state: State) -> None:
        """One summary per restart, on the store host: who interrupted and why."""
        try:
            records = self._coord.interruptions(state.iteration, range(state.initial_world_size))
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
