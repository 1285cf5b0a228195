"""Exception types raised by the in-process restart wrapper.

``RankShouldRestart`` is the one exception that travels asynchronously (injected
into the main thread by the monitor thread); it derives from ``BaseException`` so
a training loop's ``except Exception`` cannot swallow a restart.  ``RestartAbort``
is a different thing: the wrapper has given up restarting (``RetryController``'s
limits), which NVIDIA's users catch under that name.  The names NVIDIA's
``inprocess`` users catch (``RestartError`` above ``HealthCheckError`` and
``InternalError``) are the same classes here.
"""

from __future__ import annotations


class RankShouldRestart(BaseException):
    """Injected into the main thread to make it leave the wrapped function now.

    Raised by the function itself (not injected), it asks for a restart: the
    wrapper treats it as a fault (``RestartRequested``) and every rank re-enters.
    """


class RestartAbort(BaseException):
    """Terminal: no further restart is attempted on this rank.

    A ``BaseException`` as in NVIDIA's ``inprocess``, so code that ends its job on
    ``except RestartAbort`` keeps working.  Raised from a hook or the function, it
    leaves the wrapper unchanged like any other ``BaseException``.
    """


class InProcessError(RuntimeError):
    """Base class for every error the wrapper raises to its caller."""


class RestartRequested(InProcessError):
    """The function raised ``RankShouldRestart`` itself: a fault like any other.

    Every rank restarts, as NVIDIA's wrapper does for the same raise; the
    original exception is ``__cause__``.
    """


class ConfigError(InProcessError, ValueError):
    """An option of ``Wrapper`` has a wrong type or breaks an ordering rule."""


class RestartError(InProcessError):
    """The job cannot go on restarting on this rank (e.g. ``max_iterations``, no ranks left).

    Also the base of ``HealthCheckError``, ``InternalError`` and ``BarrierTimeout``,
    as NVIDIA's ``inprocess.exception.RestartError`` is.
    """


class RestartLimitReached(RestartError, RestartAbort):
    """A restart limit was reached (``RetryController``, ``max_iterations``).

    Both a ``RestartError`` (stalwart's name for "this rank stops restarting") and
    a ``RestartAbort`` (the name NVIDIA's ``RetryController`` raises), so either
    ``except`` clause catches it.
    """


class InternalError(RestartError):
    """The wrapper itself broke an invariant (e.g. a rank assignment left ranks unplaced)."""


class BarrierTimeout(RestartError):
    """A store barrier did not complete in time."""


class RankDiscarded(RestartError):
    """A rank assignment found this rank among the terminated ones: it leaves the job.

    NVIDIA ``inprocess``'s name (``inprocess.rank_assignment.RankDiscarded``); raised to
    the caller of the wrapped function on that rank, as NVIDIA's is.
    """


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
