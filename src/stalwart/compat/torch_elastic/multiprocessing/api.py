"""``torch.distributed.elastic.multiprocessing.api`` (see
``stalwart.launch.workers.torch_processes``)."""

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
    _terminate_process_handler,
    _validate_full_rank,
    _wrap,
    to_map,
)

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "MultiprocessContext",
    "PContext",
    "RunProcsResult",
    "SignalException",
    "Std",
    "SubprocessContext",
    "_terminate_process_handler",
    "_validate_full_rank",
    "_wrap",
    "to_map",
]
