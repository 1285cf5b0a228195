"""The exceptions under the module path NVIDIA ``inprocess`` users import them from
(``inprocess.exception.RestartError``); defined in ``errors``."""

from .errors import (
    BarrierTimeout,
    HealthCheckError,
    InternalError,
    RankShouldRestart,
    RestartAbort,
    RestartError,
    RestartLimitReached,
)

# NVIDIA names its barrier timeout ``TimeoutError`` (shadowing the builtin in its module).
TimeoutError = BarrierTimeout

__all__ = [
    "HealthCheckError",
    "InternalError",
    "RankShouldRestart",
    "RestartAbort",
    "RestartError",
    "RestartLimitReached",
    "TimeoutError",
]
