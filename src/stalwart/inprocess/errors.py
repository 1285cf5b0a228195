"""Exception types raised by the in-process restart wrapper.

``RankShouldRestart`` (also spelled ``RestartAbort``, stalwart's first name for
it) is the one exception that travels asynchronously (injected into the main
thread by the monitor thread); it derives from ``BaseException`` so a training
loop's ``except Exception`` cannot swallow a restart.  The names NVIDIA's
``inprocess`` users catch (``RestartError`` above ``HealthCheckError`` and
``InternalError``) are the same classes here.
"""

from __future__ import annotations


class RankShouldRestart(BaseException):
    """Injected into the main thread to make it leave the wrapped function now.

    Raised by the function itself (not injected), it ends the wrapper on this
    rank like any other ``BaseException``.
    """


RestartAbort = RankShouldRestart


class InProcessError(RuntimeError):
    """Base class for every error the wrapper raises to its caller."""


class ConfigError(InProcessError, ValueError):
    """An option of ``Wrapper`` has a wrong type or breaks an ordering rule."""


class RestartError(InProcessError):
    """The job cannot go on restarting on this rank (e.g. ``max_iterations``, no ranks left).

    Also the base of ``HealthCheckError``, ``InternalError`` and ``BarrierTimeout``,
    as NVIDIA's ``inprocess.exception.RestartError`` is.
    """


class InternalError(RestartError):
    """The wrapper itself broke an invariant (e.g. a rank assignment left ranks unplaced)."""


class BarrierTimeout(RestartError):
    """A store barrier did not complete in time."""


class RankTerminated(InProcessError):
    """This rank was declared terminated by the job and must not re-enter."""


class HookError(InProcessError):
    """A user hook (initialize, finalize, health check, abort) raised."""

    def __init__(self, hook: str, rank: int, iteration: int, cause: BaseException) -> None:
        super().__init__(
            f"{hook} hook failed on rank {rank} in iteration {iteration}: "
            f"{type(cause).__name__}: {cause}"
        )
        self.hook = hook
        self.rank = rank
        self.iteration = iteration


class HealthCheckError(HookError, RestartError):
    """The health check failed after a fault: the rank leaves the job."""
