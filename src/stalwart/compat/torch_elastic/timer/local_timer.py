"""``torch.distributed.elastic.timer.local_timer`` (see
``stalwart.monitor.torch_local_timer``)."""

from stalwart.monitor.torch_local_timer import (
    LocalTimerClient,
    LocalTimerServer,
    MultiprocessingRequestQueue,
)

__all__ = ["LocalTimerClient", "LocalTimerServer", "MultiprocessingRequestQueue"]
