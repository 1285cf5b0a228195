"""``torch.distributed.elastic.multiprocessing`` (see
``stalwart.launch.workers.torch_processes`` and ``.torch_errors``)."""

from stalwart.launch.workers.torch_errors import ProcessFailure, record
from stalwart.launch.workers.torch_processes import (
    DefaultLogsSpecs,
    LogsDest,
    LogsSpecs,
    MultiprocessContext,
    PContext,
    RunProcsResult,
    SignalException,
    Std,
    SubprocessContext,
    start_processes,
    to_map,
)

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "MultiprocessContext",
    "PContext",
    "ProcessFailure",
    "RunProcsResult",
    "SignalException",
    "Std",
    "SubprocessContext",
    "record",
    "start_processes",
    "to_map",
]
