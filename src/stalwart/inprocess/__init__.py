"""In-process restart: re-enter a distributed training function on every healthy rank
after a fault anywhere, in the same processes, without relaunching.

Works under plain ``torchrun`` and under ``stalwart run`` (never imports
``stalwart.launch``); ranks learn everything from torchrun's environment.
"""

from .abort import Abort, AbortTorchDistributed, destroy_process_groups
from .assignment import ActiveWorldSize, RankAssignment, RankFilter, ShiftRanks
from .call import Call
from .errors import (
    BarrierTimeout,
    ConfigError,
    HealthCheckError,
    HookError,
    InProcessError,
    RankTerminated,
    RestartAbort,
    RestartError,
)
from .state import Interruption, InterruptionRecord, Mode, State
from .store import tcp_store
from .wrapper import Wrapper

__all__ = [
    "Abort",
    "AbortTorchDistributed",
    "ActiveWorldSize",
    "BarrierTimeout",
    "Call",
    "ConfigError",
    "HealthCheckError",
    "HookError",
    "InProcessError",
    "Interruption",
    "InterruptionRecord",
    "Mode",
    "RankAssignment",
    "RankFilter",
    "RankTerminated",
    "RestartAbort",
    "RestartError",
    "ShiftRanks",
    "State",
    "Wrapper",
    "destroy_process_groups",
    "tcp_store",
]
