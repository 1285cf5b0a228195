"""``stalwart.timer``: named-pipe timers, the worker side (see ``stalwart.monitor.timer``).

Lets ``import stalwart.timer`` and ``from stalwart.timer import expires`` work as the
README shows; the implementation (and its per-process state) lives in one place.
"""

from stalwart.monitor.timer import (
    PipeError,
    TimerClient,
    TimerUnavailableError,
    expires,
    timer_file_from_env,
)

__all__ = ["PipeError", "TimerClient", "TimerUnavailableError", "expires", "timer_file_from_env"]
