"""Exception types raised by the in-process restart wrapper.

``RestartAbort`` is the one exception that travels asynchronously (injected into
the main thread by the monitor thread); it derives from ``BaseException`` so a
training loop's ``except Exception`` cannot swallow a restart.
"""

from __future__ import annotations


class RestartAbort(BaseException):
    """Injected into the main thread to make it leave the wrapped function now."""


class InProcessError(RuntimeError):
    """Base class for every error the wrapper raises to its caller."""


class ConfigError(InProcessError, ValueError):
    """An option of ``Wrapper`` has a wrong type or breaks an ordering rule."""


class BarrierTimeout(InProcessError):
    """A store barrier did not complete in time."""


class RestartError(InProcessError):
    """The job cannot go on restarting (e.g. ``max_iterations`` reached, no ranks left)."""


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


class HealthCheckError(HookError):
    """The health check failed after a fault: the rank leaves the job."""
