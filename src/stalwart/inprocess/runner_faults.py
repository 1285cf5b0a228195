"""What one rank does about a fault: record it in the store, report it, run the abort,
``finalize`` and health-check hooks, and let go of the failed iteration's groups.

`FaultHandling` owns none of the runner's state: it is given the options (for the
hooks), the store client, the group keeper and the progress clock, and each call is
given the rank's current `State`.  Which record a fault leaves is `interruption_record`,
a pure function.
"""

from __future__ import annotations

import gc
import logging
import traceback
import typing

from .abort import destroy_process_groups
from .errors import HealthCheckError, HookError, InternalError
from .groups import GroupKeeper
from .hooks import call_hook
from .options import Options
from .progress import ProgressClock
from .state import Interruption, InterruptionRecord, State
from .store import CoordStore

# The runner's logger: users filter on it, whichever part speaks.
log = logging.getLogger("stalwart.inprocess.runner")


def interruption_record(
    state: State, exc: BaseException, *, leaving: bool = False
) -> InterruptionRecord:
    """The record peers read about this rank's fault: a rank that leaves (any
    ``BaseException`` it ends with) is ``BASE_EXCEPTION``; otherwise a failed hook is
    ``HOOK`` and anything else ``EXCEPTION``."""
    if leaving:
        kind = Interruption.BASE_EXCEPTION
    elif isinstance(exc, HookError):
        kind = Interruption.HOOK
    else:
        kind = Interruption.EXCEPTION
    return InterruptionRecord(
        state.initial_rank, state.iteration, kind, f"{type(exc).__name__}: {exc}"
    )


def drop_tracebacks(error: BaseException) -> None:
    """Clear the tracebacks along the cause/context chain (a cycle ends it): they pin
    the failed iteration's frames, and with them its DDP, groups and tensors."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__


def expect_state(name: str, value: object) -> State:
    """What a hook returned, when it must be a `State`."""
    if not isinstance(value, State):
        raise InternalError(f"{name} must return a State or None, got {type(value).__name__}")
    return value


def hook_failed(name: str, state: State, exc: Exception) -> typing.NoReturn:
    log.error("%s hook failed on rank %d in iteration %d", name, state.rank, state.iteration)
    raise HookError(name, state.rank, state.iteration, exc) from exc


class FaultHandling:
    """Records, reports and cleans up after a fault on this rank (see the module doc)."""

    def __init__(
        self, opts: Options, coord: CoordStore, groups: GroupKeeper, clock: ProgressClock
    ) -> None:
        self._opts = opts
        self._coord = coord
        self._groups = groups
        self._clock = clock

    def record_exit(self, state: State, exc: BaseException) -> None:
        """Tell the peers first: this rank's iteration ends and the rank leaves."""
        self._store_record(interruption_record(state, exc, leaving=True))

    def record(self, state: State, error: Exception) -> None:
        self._store_record(interruption_record(state, error))

    def _store_record(self, record: InterruptionRecord) -> None:
        try:
            self._coord.record_interruption(record)
        except Exception:
            log.exception("could not record the interruption in the store")

    def report(self, state: State, error: Exception, aborted: bool) -> None:
        """Log the fault, and run the abort hook unless the monitor thread has already."""
        log.warning(
            "rank %d iteration %d failed: %s",
            state.rank,
            state.iteration,
            "".join(traceback.format_exception_only(type(error), error)).strip(),
        )
        log.debug("traceback", exc_info=error)
        drop_tracebacks(error)
        if self._opts.abort is not None and not aborted:
            try:
                self._opts.abort(state)
            except Exception as exc:
                log.exception("abort failed")
                raise HookError("abort", state.rank, state.iteration, exc) from exc

    def after_fault(self, state: State, error: Exception | None) -> None:
        destroy_process_groups()
        self._groups.release()
        self._clock.disarm()
        self.finalize(state, error)
        self.health_check(state, error)
        gc.collect()

    def finalize(self, state: State, error: BaseException | None) -> None:
        if self._opts.finalize is None:
            return
        try:
            call_hook("finalize", self._opts.finalize, state.freeze(), error)
        except Exception as exc:
            # As NVIDIA's wrapper: the hook's own exception reaches the caller (chained
            # from the fault), so code that catches its type keeps working; the note
            # says where it happened.
            log.error(
                "finalize hook failed on rank %d in iteration %d", state.rank, state.iteration
            )
            exc.add_note(
                f"stalwart: raised by the finalize hook on rank {state.rank} "
                f"in iteration {state.iteration}"
            )
            if error is not None and exc.__cause__ is None:
                raise exc from error
            raise

    def health_check(self, state: State, error: BaseException | None) -> None:
        """Before each iteration (``error`` None) and after a fault (the fault's exception)."""
        if self._opts.health_check is None:
            return
        try:
            call_hook("health_check", self._opts.health_check, state.freeze(), error)
        except Exception as exc:
            log.error("rank %d failed its health check: %s", state.rank, exc)
            raise HealthCheckError("health_check", state.rank, state.iteration, exc) from exc
