"""What one rank does about a fault: record it in the store, report it, run the abort,
``finalize`` and health-check hooks, and let go of the failed iteration's groups.
``runner.Runner`` inherits it; the fields it reads are the runner's, declared here.
"""

from __future__ import annotations

import gc
import logging
import traceback
import typing

from .abort import destroy_process_groups
from .errors import HealthCheckError, HookError, InternalError
from .groups import GroupKeeper
from .options import Options
from .progress import ProgressClock
from .state import Interruption, InterruptionRecord, State
from .store import CoordStore

log = logging.getLogger("stalwart.inprocess.runner")


class RunnerFaults:
    """The fault-handling half of `Runner` (see the module doc)."""

    opts: Options
    coord: CoordStore
    groups: GroupKeeper
    clock: ProgressClock

    def _record_exit(self, state: State, exc: BaseException) -> None:
        """Tell the peers first: this rank's iteration ends and the rank leaves."""
        record = InterruptionRecord(
            state.initial_rank,
            state.iteration,
            Interruption.BASE_EXCEPTION,
            f"{type(exc).__name__}: {exc}",
        )
        try:
            self.coord.record_interruption(record)
        except Exception:
            log.exception("could not record the interruption in the store")

    def _record(self, state: State, error: Exception) -> None:
        kind = Interruption.HOOK if isinstance(error, HookError) else Interruption.EXCEPTION
        record = InterruptionRecord(
            state.initial_rank, state.iteration, kind, f"{type(error).__name__}: {error}"
        )
        try:
            self.coord.record_interruption(record)
        except Exception:
            log.exception("could not record the interruption in the store")

    def _report_fault(self, state: State, error: Exception, aborted: bool) -> None:
        log.warning(
            "rank %d iteration %d failed: %s",
            state.rank,
            state.iteration,
            "".join(traceback.format_exception_only(type(error), error)).strip(),
        )
        log.debug("traceback", exc_info=error)
        # The tracebacks pin the failed iteration's frames (its DDP, groups, tensors).
        seen: set[int] = set()
        link: BaseException | None = error
        while link is not None and id(link) not in seen:
            seen.add(id(link))
            link.__traceback__ = None
            link = link.__cause__ or link.__context__
        if self.opts.abort is not None and not aborted:
            try:
                self.opts.abort(state)
            except Exception as exc:
                log.exception("abort failed")
                raise HookError("abort", state.rank, state.iteration, exc) from exc

    def _after_fault(self, state: State, error: Exception | None) -> None:
        destroy_process_groups()
        self.groups.release()
        self.clock.disarm()
        self._finalize(state, error)
        self._health_check(state, error)
        gc.collect()

    def _finalize(self, state: State, error: BaseException | None) -> None:
        if self.opts.finalize is None:
            return
        try:
            self.opts.finalize(state, error)
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

    def _health_check(self, state: State, error: BaseException | None) -> None:
        """Before each iteration (``error`` None) and after a fault (the fault's exception)."""
        if self.opts.health_check is None:
            return
        try:
            self.opts.health_check(state, error)
        except Exception as exc:
            log.error("rank %d failed its health check: %s", state.rank, exc)
            raise HealthCheckError("health_check", state.rank, state.iteration, exc) from exc

    def _expect_state(self, name: str, value: object) -> State:
        if not isinstance(value, State):
            raise InternalError(f"{name} must return a State or None, got {type(value).__name__}")
        return value

    def _hook_failed(self, name: str, state: State, exc: Exception) -> typing.NoReturn:
        log.error("%s hook failed on rank %d in iteration %d", name, state.rank, state.iteration)
        raise HookError(name, state.rank, state.iteration, exc) from exc
