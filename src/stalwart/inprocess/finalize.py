"""``finalize`` hooks in NVIDIA ``inprocess``'s shape: ``finalize(state, exception)``.

Runs after an interrupted iteration (with the exception this rank saw, or
``None`` when a peer's fault interrupted it) and once after the completed
last iteration (with ``None``).  An exception here takes the rank out of the
job and reaches the wrapper's caller as itself, as with NVIDIA's wrapper.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any, Protocol

from .errors import BarrierTimeout
from .state import State


class Finalize(Protocol):
    def __call__(self, state: State, train_ex: BaseException | None = None) -> object: ...


class ThreadedFinalize:
    """Run ``fn(*args, **kwargs)`` in a thread and give it ``timeout`` to finish.

    For cleanup that can hang (flushing to a dead file system, a CUDA sync):
    past the timeout the rank is declared unhealthy rather than stuck.
    """

    def __init__(
        self,
        timeout: datetime.timedelta,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.timeout = timeout
        self.fn = fn
        self.args = args
        self.kwargs = kwargs or {}

    def __call__(self, state: State, train_ex: BaseException | None = None) -> object:
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self.fn(*self.args, **self.kwargs)
            except BaseException as exc:  # handed to the caller's thread below
                failure.append(exc)

        thread = threading.Thread(target=run, name="ThreadedFinalize", daemon=True)
        thread.start()
        thread.join(self.timeout.total_seconds())
        if thread.is_alive():
            raise BarrierTimeout(
                f"finalize {self.fn!r} did not return in {self.timeout.total_seconds():g}s"
            )
        if failure:
            raise failure[0]
        return state, train_ex
