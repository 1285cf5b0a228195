"""``torch.distributed.elastic.multiprocessing.errors`` (see
``stalwart.launch.workers.torch_errors``)."""

from stalwart.launch.workers.torch_errors import (
    ChildFailedError,
    ErrorHandler,
    ProcessFailure,
    get_error_handler,
    record,
)

__all__ = ["ChildFailedError", "ErrorHandler", "ProcessFailure", "get_error_handler", "record"]
