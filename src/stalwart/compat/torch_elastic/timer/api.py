"""``torch.distributed.elastic.timer.api`` (see ``stalwart.monitor.torch_timer``)."""

from stalwart.monitor.torch_timer import (
    RequestQueue,
    TimerClient,
    TimerRequest,
    TimerServer,
    configure,
    expires,
)

__all__ = ["RequestQueue", "TimerClient", "TimerRequest", "TimerServer", "configure", "expires"]
