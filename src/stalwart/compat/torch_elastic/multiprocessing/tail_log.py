"""``torch.distributed.elastic.multiprocessing.tail_log`` (see
``stalwart.launch.files.tail_log``)."""

from stalwart.launch.files.tail_log import TailLog, logger

__all__ = ["TailLog", "logger"]
