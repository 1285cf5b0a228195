"""``torch.distributed.elastic.timer.file_based_local_timer``."""

from stalwart.monitor.file_timer import (
    FileTimerClient,
    FileTimerRequest,
    FileTimerServer,
    log_debug_info_for_expired_timers,
)

__all__ = [
    "FileTimerClient",
    "FileTimerRequest",
    "FileTimerServer",
    "log_debug_info_for_expired_timers",
]
