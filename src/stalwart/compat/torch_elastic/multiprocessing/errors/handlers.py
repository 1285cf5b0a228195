"""``torch.distributed.elastic.multiprocessing.errors.handlers``."""

from stalwart.launch.workers.torch_errors import get_error_handler

__all__ = ["get_error_handler"]
