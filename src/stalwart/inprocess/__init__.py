"""In-process restart: re-enter a distributed training function on every healthy rank
after a fault anywhere, in the same processes, without relaunching.

Works under plain ``torchrun`` and under ``stalwart run`` (never imports
``stalwart.launch``); ranks learn everything from torchrun's environment.
Code written for NVIDIA's ``nvidia_resiliency_ext.inprocess`` runs with its
import line changed: its hook shapes, ``Compose``, ``CallWrapper`` and
exception names, and its submodule paths (``exception``, ``initialize``, ``abort``,
``finalize``, ``health_check``, ``rank_assignment``, ``rank_filter``,
``monitor_thread``, ``progress_watchdog``) are all here.
"""

from . import (
    abort,
    exception,
    finalize,
    health_check,
    initialize,
    monitor_thread,
    progress_watchdog,
    rank_assignment,
    rank_filter,
    wrap,
)
from .abort import Abort, AbortTorchDistributed, abort_nccl_communicators, destroy_process_groups
from .assignment import ActiveWorldSize, FillGaps, RankAssignment, RankFilter, ShiftRanks
from .call import Call, CallWrapper
from .errors import (
    BarrierTimeout,
    ConfigError,
    HealthCheckError,
    HookError,
    InProcessError,
    InternalError,
    RankDiscarded,
    RankShouldRestart,
    RankTerminated,
    RestartAbort,
    RestartError,
    RestartLimitReached,
)
from .hooks import Compose
from .state import Interruption, InterruptionRecord, Mode, State
from .store import tcp_store
from .wrapper import Wrapper

__all__ = [
    "Abort",
    "AbortTorchDistributed",
    "ActiveWorldSize",
    "BarrierTimeout",
    "Call",
    "CallWrapper",
    "Compose",
    "ConfigError",
    "FillGaps",
    "HealthCheckError",
    "HookError",
    "InProcessError",
    "InternalError",
    "Interruption",
    "InterruptionRecord",
    "Mode",
    "RankAssignment",
    "RankDiscarded",
    "RankFilter",
    "RankShouldRestart",
    "RankTerminated",
    "RestartAbort",
    "RestartError",
    "RestartLimitReached",
    "ShiftRanks",
    "State",
    "Wrapper",
    "abort",
    "abort_nccl_communicators",
    "destroy_process_groups",
    "exception",
    "finalize",
    "health_check",
    "initialize",
    "monitor_thread",
    "progress_watchdog",
    "rank_assignment",
    "rank_filter",
    "tcp_store",
    "wrap",
]
