"""`TimeoutsCalc`: timeouts learned from observed heartbeat and section timing, under the
module path and with the calls of NVIDIA's `fault_tolerance.timeouts_calc` (issue 26,
seed 004).

The calculator is pure bookkeeping over times the caller passes in (or the monotonic
clock): the first heartbeat's delay after start, the longest gap between heartbeats,
each named section's longest duration, and the longest stretch with no section open.
A timeout is that interval times the safety factor; merging with timeouts already in
force (say, restored from a checkpoint) averages two learned values (EMA, alpha 0.5)
and lets a learned value replace a configured one. `synchronize_all` makes every rank
of the default process group hold the longest intervals any rank saw, exchanged as
JSON through `learned.gather_json`, as the client's own learning does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from stalwart.monitor.client import RankMonitorError
from stalwart.monitor.data import HeartbeatTimeouts, SectionAction, SectionTimeouts
from stalwart.monitor.learned import Observations, gather_json, merge_max

#: Weight of the newly computed value when it is merged with an already learned one.
_EMA_ALPHA = 0.5


class TimeoutsCalcError(RankMonitorError):
    """A section event that does not fit the sections' state, or timeouts asked for
    before the intervals they need were observed."""


def _ema(old: float, new: float) -> float:
    return _EMA_ALPHA * new + (1.0 - _EMA_ALPHA) * old


def _time(value: float | None, what: str) -> float:
    if value is None:
        return time.monotonic()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TimeoutsCalcError(f"{what} must be a finite number of seconds, got {value!r}")
    return float(value)


def _longer(current: float | None, interval: float) -> float:
    return interval if current is None or interval > current else current


class TimeoutsCalc:
    """Learns heartbeat, section and out-of-section timeouts from observed intervals.

    sections: the section names events may use (others are refused).
    start_time: when the workload started (default: now, on the monotonic clock); the
        first heartbeat's delay and the first out-of-section stretch count from it.
    safety_factor: a timeout is the longest observed interval times this.
    """

    def __init__(
        self,
        sections: Iterable[str] | None = None,
        start_time: float | None = None,
        safety_factor: float = 5.0,
    ) -> None:
        names = [] if sections is None else list(sections)
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"section names must be non-empty strings, got {name!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"section names must be unique, got {names!r}")
        if (
            isinstance(safety_factor, bool)
            or not isinstance(safety_factor, int | float)
            or not math.isfinite(safety_factor)
            or safety_factor < 1
        ):
            raise ValueError(f"safety_factor must be a finite number >= 1, got {safety_factor!r}")
        self.sections: tuple[str, ...] = tuple(names)
        self.safety_factor = float(safety_factor)
        self.start_time = _time(start_time, "start_time")
        self._observed = Observations()
        self._last_hb: float | None = None
        self._open: dict[str, float] = {}
        # When the current stretch with no section open began (None while one is open).
        self._oos_since: float | None = self.start_time
        self._sync_seq = 0

    # -- observations ------------------------------------------------------------------
    def update_on_heartbeat(self, hb_time: float | None = None) -> None:
        now = _time(hb_time, "hb_time")
        obs = self._observed
        if self._last_hb is None:
            obs.hb_initial = _longer(obs.hb_initial, max(0.0, now - self.start_time))
        else:
            obs.hb = _longer(obs.hb, max(0.0, now - self._last_hb))
        self._last_hb = now

    def update_on_section_event(
        self, section: str | None, action: SectionAction, event_time: float | None = None
    ) -> None:
        now = _time(event_time, "event_time")
        if action is SectionAction.CLOSE_ALL:
            for name in list(self._open):
                self._close(name, now)
            return
        if section not in self.sections:
            raise TimeoutsCalcError(
                f"unknown section {section!r}; the calculator was given {list(self.sections)}"
            )
        if action is SectionAction.OPEN:
            if section in self._open:
                raise TimeoutsCalcError(f"section {section!r} is already open")
            if not self._open and self._oos_since is not None:
                self._observe_oos(now - self._oos_since)
                self._oos_since = None
            self._open[section] = now
        elif action is SectionAction.CLOSE:
            if section not in self._open:
                raise TimeoutsCalcError(f"section {section!r} is not open")
            self._close(section, now)
        else:
            raise TimeoutsCalcError(f"unknown section action {action!r}; expected a SectionAction")

    def _close(self, name: str, now: float) -> None:
        opened = self._open.pop(name)
        sections = self._observed.sections
        sections[name] = _longer(sections.get(name), max(0.0, now - opened))
        if not self._open:
            self._oos_since = now

    def _observe_oos(self, interval: float) -> None:
        self._observed.oos = _longer(self._observed.oos, max(0.0, interval))

    def maybe_bump_oos_time(self, curr_time: float | None = None) -> None:
        """Counts the out-of-section stretch still running, if it is the longest yet."""
        now = _time(curr_time, "curr_time")
        if not self._open and self._oos_since is not None and now > self._oos_since:
            self._observe_oos(now - self._oos_since)

    # -- timeouts ----------------------------------------------------------------------
    def can_get_hb_timeouts(self) -> bool:
        return self._observed.hb_initial is not None and self._observed.hb is not None

    def get_hb_timeouts(self, current: HeartbeatTimeouts | None = None) -> HeartbeatTimeouts:
        """The learned heartbeat timeouts, merged into `current` when it was learned too."""
        obs = self._observed
        if obs.hb_initial is None or obs.hb is None:
            raise TimeoutsCalcError("two heartbeats are needed to compute heartbeat timeouts")
        initial, subsequent = obs.hb_initial * self.safety_factor, obs.hb * self.safety_factor
        if current is not None and current.were_calculated:
            if current.initial is None or current.subsequent is None:
                raise TimeoutsCalcError(
                    f"current heartbeat timeouts are marked calculated but incomplete: {current}"
                )
            initial = _ema(current.initial, initial)
            subsequent = _ema(current.subsequent, subsequent)
        return HeartbeatTimeouts(initial, subsequent, were_calculated=True)

    def _selected(self, selected_sections: Iterable[str] | None) -> list[str]:
        if selected_sections is None:
            return list(self.sections)
        chosen = list(selected_sections)
        unknown = [name for name in chosen if name not in self.sections]
        if unknown:
            raise TimeoutsCalcError(
                f"unknown section(s) {unknown}; the calculator was given {list(self.sections)}"
            )
        return chosen

    def can_get_section_timeouts(
        self, selected_sections: Iterable[str] | None = None, calc_out_of_section: bool = True
    ) -> bool:
        seen = self._observed.sections
        if any(name not in seen for name in self._selected(selected_sections)):
            return False
        return not calc_out_of_section or self._observed.oos is not None

    def get_section_timeouts(
        self,
        selected_sections: Iterable[str] | None = None,
        calc_out_of_section: bool = True,
        current: SectionTimeouts | None = None,
    ) -> SectionTimeouts:
        """Learned timeouts for the selected sections (all by default) and, if asked, the
        out-of-section stretch; the others are None, or `current`'s when it is given."""
        chosen = self._selected(selected_sections)
        if not self.can_get_section_timeouts(chosen, calc_out_of_section):
            missing = [n for n in chosen if n not in self._observed.sections]
            if calc_out_of_section and self._observed.oos is None:
                missing.append("out-of-section")
            raise TimeoutsCalcError(f"no complete interval observed yet for {missing}")
        sf = self.safety_factor
        seen = self._observed.sections
        oos = self._observed.oos
        new = SectionTimeouts(
            section={n: (seen[n] * sf if n in chosen else None) for n in self.sections},
            out_of_section=oos * sf if calc_out_of_section and oos is not None else None,
            calculated_sections=frozenset(chosen),
            is_out_of_section_calculated=calc_out_of_section,
        )
        return new if current is None else self._get_merged_section_timeouts(new, current)

    @staticmethod
    def _get_merged_section_timeouts(
        new: SectionTimeouts, current: SectionTimeouts
    ) -> SectionTimeouts:
        """`current` with `new`'s learned values put in: averaged with a value `current`
        learned too, replacing a configured one; `current`'s other values stay."""

        def merged(
            name: str, new_value: float | None, old_value: float | None, old_calc: bool
        ) -> float:
            if new_value is None:
                raise TimeoutsCalcError(f"{name}: marked calculated but has no value")
            if not old_calc:
                return new_value
            if old_value is None:
                raise TimeoutsCalcError(f"current {name}: marked calculated but has no value")
            return _ema(old_value, new_value)

        table: dict[str, float | None] = dict(current.section)
        for name, value in new.section.items():
            if name in new.calculated_sections:
                table[name] = merged(
                    f"section {name!r}",
                    value,
                    current.section.get(name),
                    name in current.calculated_sections,
                )
            elif name not in table:
                table[name] = value
        oos = current.out_of_section
        if new.is_out_of_section_calculated:
            oos = merged(
                "out_of_section",
                new.out_of_section,
                current.out_of_section,
                current.is_out_of_section_calculated,
            )
        return SectionTimeouts(
            section=table,
            out_of_section=oos,
            calculated_sections=new.calculated_sections | current.calculated_sections,
            is_out_of_section_calculated=(
                new.is_out_of_section_calculated or current.is_out_of_section_calculated
            ),
        )

    # -- across ranks ------------------------------------------------------------------
    def synchronize_all(self) -> None:
        """Collective over the default process group: afterwards every rank holds the
        longest intervals any rank observed, so all compute the same timeouts."""
        import sys

        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            raise TimeoutsCalcError(
                "synchronize_all needs the default torch.distributed process group "
                "(call init_process_group first)"
            )
        self._sync_seq += 1
        payloads = gather_json(self._observed.to_json(), None, self._sync_seq)
        for rank, payload in enumerate(payloads):
            if not isinstance(payload, dict) or not isinstance(payload.get("sections", {}), dict):
                raise TimeoutsCalcError(
                    f"rank {rank} sent {str(payload)[:200]!r}; expected observed intervals "
                    "(hb_initial, hb, sections, oos)"
                )
        self._observed = merge_max([Observations.from_json(p) for p in payloads])
