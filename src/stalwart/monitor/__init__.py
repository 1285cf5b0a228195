"""Hang detection: named-pipe timers, heartbeat/section slots in shared memory, learned
timeouts, and the node monitor that turns a missed deadline into a stack dump, a
terminated worker and a `HangReport` for the supervisor.

Worker side: `RankMonitorClient`, `timer.expires`, `stacks.install`.
Launcher side: `NodeMonitor`, `MonitorConfig`.
Nothing here imports torch at import time, nor the launcher.
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
    from stalwart.monitor.ft_config import FaultToleranceConfig
    from stalwart.monitor.node import NodeMonitor
    from stalwart.monitor.nvidia_server import RankMonitorServer
    from stalwart.monitor.reports import ControlAction, ControlRequest, HangKind, HangReport
    from stalwart.monitor.timeouts_in_force import HeartbeatTimeouts, SectionTimeouts
    from stalwart.monitor.timer import TimerClient, TimerUnavailableError, expires

# Loaded on first use: the launcher's settings import `stalwart.monitor.config` alone
# (every `stalwart run`, a usage error's included), and that must not load the node
# monitor, the client and NVIDIA's server with it (about 0.15 s).
_HOME = {
    "RankMonitorClient": "client",
    "RankMonitorClientError": "client",
    "RankMonitorError": "client",
    "MonitorConfig": "config",
    "FaultToleranceConfig": "ft_config",
    "NodeMonitor": "node",
    "RankMonitorServer": "nvidia_server",
    "ControlAction": "reports",
    "ControlRequest": "reports",
    "HangKind": "reports",
    "HangReport": "reports",
    "HeartbeatTimeouts": "timeouts_in_force",
    "SectionTimeouts": "timeouts_in_force",
    "TimerClient": "timer",
    "TimerUnavailableError": "timer",
    "expires": "timer",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        # A submodule by attribute (`fault_tolerance.data`), as when they were all loaded.
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})


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
