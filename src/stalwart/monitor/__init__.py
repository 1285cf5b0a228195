"""Hang detection: named-pipe timers, heartbeat/section slots in shared memory, learned
timeouts, and the node monitor that turns a missed deadline into a stack dump, a
terminated worker and a `HangReport` for the supervisor.

Worker side: `RankMonitorClient`, `timer.expires`, `stacks.install`.
Launcher side: `NodeMonitor`, `MonitorConfig`.
Nothing here imports torch at import time, nor the launcher.
"""

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
