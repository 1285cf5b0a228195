"""``torch.distributed.elastic.timer``: file-based timers (see ``stalwart.monitor.file_timer``)."""

from stalwart.monitor.file_timer import (
    FileTimerClient,
    FileTimerRequest,
    FileTimerServer,
    configure,
    expires,
)

__all__ = ["FileTimerClient", "FileTimerRequest", "FileTimerServer", "configure", "expires"]
