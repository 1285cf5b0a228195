"""Waiting helpers under the module path of NVIDIA's `fault_tolerance.utils` (issue 26,
seed 004), for code that starts its ranks with multiprocessing and waits for them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol


class _Event(Protocol):
    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


def wait_for_mp_events(events: Sequence[_Event], timeout: float) -> None:
    """Returns once every event is set; raises TimeoutError naming how many were not
    set within `timeout` seconds (shared by all of them, not per event)."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
    deadline = time.monotonic() + timeout
    for event in events:
        event.wait(max(0.0, deadline - time.monotonic()))
    unset = sum(1 for event in events if not event.is_set())
    if unset:
        raise TimeoutError(f"{unset} of {len(events)} events were not set within {timeout} s")
