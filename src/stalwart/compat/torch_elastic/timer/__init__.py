"""``torch.distributed.elastic.timer``: the timer API (see ``stalwart.monitor.torch_timer``),
file-based timers (``stalwart.monitor.file_timer``) and multiprocessing-queue timers
(``stalwart.monitor.torch_local_timer``)."""

from stalwart.monitor.file_timer import FileTimerClient, FileTimerRequest, FileTimerServer
from stalwart.monitor.torch_local_timer import LocalTimerClient, LocalTimerServer
from stalwart.monitor.torch_timer import (
    TimerClient,
    TimerRequest,
    TimerServer,
    configure,
    expires,
)

__all__ = [
    "FileTimerClient",
    "FileTimerRequest",
    "FileTimerServer",
    "LocalTimerClient",
    "LocalTimerServer",
    "TimerClient",
    "TimerRequest",
    "TimerServer",
    "configure",
    "expires",
]
