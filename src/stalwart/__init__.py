"""stalwart: keeps distributed PyTorch jobs making progress through crashes, hangs and lost nodes.

The public API, loaded on first use so that ``import stalwart`` stays cheap in every worker:

* ``stalwart.record``: decorator writing ``error.json`` (torchrun's format) on an uncaught exception
* ``stalwart.inject.step(step)``: fault injection driven by ``--inject`` / ``STALWART_INJECT``
* ``stalwart.timer.expires(after=...)``: a named-pipe timer; the launcher reaps a worker whose timer runs out
* ``stalwart.monitor.RankMonitorClient``: heartbeats, sections and learned timeouts
* ``stalwart.inprocess.Wrapper``: restart the training function inside the same processes
* ``stalwart.checkpoint.AsyncCheckpointer`` / ``load_latest``: asynchronous atomic checkpoints
* ``stalwart.launch.start_processes``: start and supervise workers from Python
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = {
    "inject",
    "launch",
    "monitor",
    "inprocess",
    "checkpoint",
    "rendezvous",
    "config",
    "timer",
}

__all__ = ["__version__", "record", *sorted(_SUBMODULES)]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"stalwart.{name}")
    if name == "record":
        from stalwart.launch.workers.errors import record

        return record
    raise AttributeError(f"module 'stalwart' has no attribute {name!r}")
