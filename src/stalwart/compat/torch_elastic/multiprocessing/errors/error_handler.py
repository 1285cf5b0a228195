"""``torch.distributed.elastic.multiprocessing.errors.error_handler``."""

from stalwart.launch.workers.torch_errors import ErrorHandler, logger

__all__ = ["ErrorHandler", "logger"]
