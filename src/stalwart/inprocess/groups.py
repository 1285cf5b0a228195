"""Holding the iteration's process groups so their last reference drops at a safe time.

Measured on torch 2.13 (gdb): freeing the last reference to a gloo process group
joins its worker threads while holding the GIL, and a worker that is still
destroying a finished work item needs the GIL to drop a Python object captured
in that item's thread-local state: a deadlock.  It struck when the user's DDP
module (whose reducer holds the group) was freed as the wrapped function
returned or as a restart unwound its frames.  So the monitor thread keeps a
reference to every group it sees during the iteration, and the main thread
drops those references only after sleeping briefly with the GIL released,
when the workers have finished their work items and exit without the GIL.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

_SETTLE = 0.02


class GroupKeeper:
    """Extra references to the process groups created during an iteration."""

    def __init__(self) -> None:
        self._held: list[Any] = []
        self._seen = -1

    def observe(self) -> None:
        """Pick up new groups (called from the monitor thread's poll loop)."""
        world = getattr(dist.distributed_c10d, "_world", None)
        pg_map = getattr(world, "pg_map", None)
        if pg_map is None:
            return
        size = len(pg_map)
        if size == self._seen:
            return
        try:
            groups = list(pg_map)
        except RuntimeError:  # resized by the main thread while copying; next poll
            return
        for group in groups:
            if not any(group is held for held in self._held):
                self._held.append(group)
        self._seen = size

    def release(self) -> None:
        """Drop the references after letting the groups' workers finish."""
        if not self._held:
            self._seen = -1
            return
        time.sleep(_SETTLE)  # GIL released: workers drop their finished work items
        self._held.clear()
        self._seen = -1
