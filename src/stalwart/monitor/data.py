"""The timeout records and the section action, under the module path NVIDIA's
`fault_tolerance.data` gives them, so code written against it needs only its import
line changed (issue 26, seed 004).

The records themselves live in `timeouts_in_force` (what a rank reports) and are the
same classes here; `SectionAction` names what a section event does in `TimeoutsCalc`.
"""

from __future__ import annotations

import enum

from stalwart.monitor import envvars
from stalwart.monitor.timeouts_in_force import HeartbeatTimeouts, SectionTimeouts

#: NVIDIA's name for the variable that tells a rank where its monitor is.
FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR = envvars.NVIDIA_IPC_SOCKET


class SectionAction(enum.Enum):
    """What a section event does: open a named section, close it, or close every open one."""

    OPEN = "open"
    CLOSE = "close"
    CLOSE_ALL = "close_all"


__all__ = [
    "FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR",
    "HeartbeatTimeouts",
    "SectionAction",
    "SectionTimeouts",
]
