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
import math
import os
from collections.abc import Iterable
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
    """Section and out-of-section timeouts in force, in NVIDIA's shape.

    `calculated_sections` names the sections whose timeout was learned (any iterable of
    names is accepted and kept as a frozenset, NVIDIA's code passes `{}` for none).
    """

    section: dict[str, float | None]
    out_of_section: float | None
    calculated_sections: frozenset[str]
    is_out_of_section_calculated: bool

    def __post_init__(self) -> None:
        if not isinstance(self.section, dict):
            raise TypeError(f"section must be a dict of name -> seconds, got {self.section!r}")
        names = self.calculated_sections
        if isinstance(names, str) or not isinstance(names, Iterable):
            raise TypeError(f"calculated_sections must be a collection of names, got {names!r}")
        # Frozen: normalising the caller's collection needs the object's own setattr.
        object.__setattr__(self, "calculated_sections", frozenset(map(str, names)))

    @property
    def are_valid(self) -> bool:
        """Every section and the out-of-section stretch have a timeout."""
        return self.out_of_section is not None and all(v is not None for v in self.section.values())

    @property
    def were_calculated(self) -> bool:
        """Every timeout here was learned, none taken from a configuration."""
        return self.is_out_of_section_calculated and self.calculated_sections >= set(self.section)


@dataclasses.dataclass(frozen=True)
class Configured:
    """The node's configured timeouts, as the launcher put them in the environment.

    A section named with None is known but not checked (NVIDIA's config allows it).
    """

    hb_initial: float | None = None
    hb: float | None = None
    sections: dict[str, float | None] = dataclasses.field(default_factory=dict)
    oos: float | None = None

    @classmethod
    def from_env(cls) -> Configured:
        raw = os.environ.get(envvars.TIMEOUTS)
        if not raw:
            return cls()
        return cls.from_json(raw)

    @classmethod
    def from_json(cls, raw: str) -> Configured:
        try:
            data = json.loads(raw)

            def secs(v: Any) -> float | None:
                ok = isinstance(v, int | float) and not isinstance(v, bool)
                return float(v) if ok and math.isfinite(v) and v > 0 else None

            sections = {str(k): secs(v) for k, v in dict(data.get("sections") or {}).items()}
            return cls(
                secs(data.get("hb_initial")), secs(data.get("hb")), sections, secs(data.get("oos"))
            )
        except (ValueError, TypeError, AttributeError):
            log.warning("ignoring malformed configured timeouts %r", raw[:200])
            return cls()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))
