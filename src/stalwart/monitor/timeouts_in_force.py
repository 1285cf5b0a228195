"""Timeouts as a rank sees them: the node's configured ones and NVIDIA's record shapes.

`Configured` is what the launcher put in the rank's environment (STALWART_MONITOR_TIMEOUTS);
`HeartbeatTimeouts` and `SectionTimeouts` are the records NVIDIA's RankMonitorClient
returns, which ``RankMonitorClient.hb_timeouts``/``section_timeouts`` fill from the
learned timeouts where there are, else from `Configured`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from stalwart.monitor import envvars

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HeartbeatTimeouts:
    """Heartbeat timeouts in force, in NVIDIA's shape (None: not checked)."""

    initial: float | None
    subsequent: float | None
    were_calculated: bool

    @property
    def are_valid(self) -> bool:
        return self.initial is not None and self.subsequent is not None


@dataclasses.dataclass(frozen=True)
class SectionTimeouts:
    """Section and out-of-section timeouts in force, in NVIDIA's shape."""

    section: dict[str, float | None]
    out_of_section: float | None
    calculated_sections: list[str]
    is_out_of_section_calculated: bool


@dataclasses.dataclass(frozen=True)
class Configured:
    """The node's configured timeouts, as the launcher put them in the environment."""

    hb_initial: float | None = None
    hb: float | None = None
    sections: dict[str, float] = dataclasses.field(default_factory=dict)
    oos: float | None = None

    @classmethod
    def from_env(cls) -> Configured:
        raw = os.environ.get(envvars.TIMEOUTS)
        if not raw:
            return cls()
        try:
            data = json.loads(raw)

            def secs(v: Any) -> float | None:
                return float(v) if isinstance(v, int | float) and v > 0 else None

            sections = {str(k): float(v) for k, v in dict(data.get("sections") or {}).items()}
            return cls(
                secs(data.get("hb_initial")), secs(data.get("hb")), sections, secs(data.get("oos"))
            )
        except (ValueError, TypeError, AttributeError):
            log.warning("ignoring malformed %s=%r", envvars.TIMEOUTS, raw[:200])
            return cls()
