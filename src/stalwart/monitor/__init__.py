"""Hang detection: named-pipe timers, heartbeat/section slots in shared memory, learned
timeouts, and the node monitor that turns a missed deadline into a stack dump, a
terminated worker and a `HangReport` for the supervisor.

Worker side: `RankMonitorClient`, `timer.expires`, `stacks.install`.
Launcher side: `NodeMonitor`, `MonitorConfig`.
Nothing here imports torch at import time, nor the launcher.

The names below load on first use: importing one light submodule (``monitor.config``,
which the CLI needs to parse its settings) must not pull in the node monitor, psutil and
msgspec, which cost a bad command line its one-line error's speed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stalwart.monitor.client import (
        RankMonitorClient,
        RankMonitorClientError,
        RankMonitorError,
    )
    from stalwart.monitor.config import MonitorConfig
    from stalwart.monitor.node import NodeMonitor
    from stalwart.monitor.nvidia_server import FaultToleranceConfig, RankMonitorServer
    from stalwart.monitor.reports import ControlAction, ControlRequest, HangKind, HangReport
    from stalwart.monitor.timeouts_in_force import HeartbeatTimeouts, SectionTimeouts
    from stalwart.monitor.timer import TimerClient, TimerUnavailableError, expires

# Each public name and the submodule that defines it.
_HOME = {
    "ControlAction": "reports",
    "ControlRequest": "reports",
    "FaultToleranceConfig": "nvidia_server",
    "HangKind": "reports",
    "HangReport": "reports",
    "HeartbeatTimeouts": "timeouts_in_force",
    "MonitorConfig": "config",
    "NodeMonitor": "node",
    "RankMonitorClient": "client",
    "RankMonitorClientError": "client",
    "RankMonitorError": "client",
    "RankMonitorServer": "nvidia_server",
    "SectionTimeouts": "timeouts_in_force",
    "TimerClient": "timer",
    "TimerUnavailableError": "timer",
    "expires": "timer",
}

__all__ = [
    "ControlAction",
    "ControlRequest",
    "FaultToleranceConfig",
    "HangKind",
    "HangReport",
    "HeartbeatTimeouts",
    "MonitorConfig",
    "NodeMonitor",
    "RankMonitorClient",
    "RankMonitorClientError",
    "RankMonitorError",
    "RankMonitorServer",
    "SectionTimeouts",
    "TimerClient",
    "TimerUnavailableError",
    "expires",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'stalwart.monitor' has no attribute {name!r}")
    return getattr(importlib.import_module(f"stalwart.monitor.{home}"), name)
