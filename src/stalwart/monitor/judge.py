"""The verdict on one rank's slot: which deadline (if any) it has missed at time `now`.

Pure functions over a `SlotSnapshot`, so the rules are tested without processes.
Timeouts a rank learned (written into its slot) take precedence over the node config.
"""

from __future__ import annotations

import dataclasses
import math

from stalwart.monitor.config import MonitorConfig
from stalwart.monitor.layout import SlotSnapshot, SlotState
from stalwart.monitor.reports import HangKind


@dataclasses.dataclass(frozen=True)
class Verdict:
    kind: HangKind
    section: str | None
    timeout: float
    last_heartbeat_age: float | None
    iteration: int | None


def effective(override: float, default: float | None) -> float | None:
    """0 in the slot means "use the config"; +inf means "explicitly not checked"."""
    if override == 0.0 or math.isnan(override):
        return default
    if math.isinf(override):
        return None
    return override


def judge(
    snap: SlotSnapshot, names: list[str], config: MonitorConfig, now: float
) -> Verdict | None:
    if snap.state != SlotState.ATTACHED or snap.pid <= 0:
        return None
    hb_age = now - snap.last_hb if snap.last_hb > 0 else None
    iteration = snap.iteration if snap.iteration >= 0 else None
    last_section = names[snap.last_section] if 0 <= snap.last_section < len(names) else None

    def verdict(kind: HangKind, timeout: float, section: str | None) -> Verdict:
        return Verdict(kind, section, timeout, hb_age, iteration)

    if snap.last_hb <= 0:
        limit = effective(snap.hb_initial_override, config.effective_initial_timeout)
        if limit is not None and snap.attach_time > 0 and now - snap.attach_time > limit:
            return verdict(HangKind.INITIAL_HEARTBEAT, limit, last_section)
    else:
        limit = effective(snap.hb_override, config.hb_timeout)
        if limit is not None and now - snap.last_hb > limit:
            return verdict(HangKind.HEARTBEAT, limit, last_section)

    any_open = False
    for idx in range(min(snap.name_count, len(names))):
        opened = snap.open_times[idx]
        if opened <= 0:
            continue
        any_open = True
        limit = effective(snap.limits[idx], config.section_timeouts.get(names[idx]))
        if limit is not None and now - opened > limit:
            return verdict(HangKind.SECTION, limit, names[idx])

    if not any_open and snap.oos_start > 0:
        limit = effective(snap.oos_override, config.out_of_section_timeout)
        if limit is not None and now - snap.oos_start > limit:
            return verdict(HangKind.OUT_OF_SECTION, limit, last_section)
    return None
