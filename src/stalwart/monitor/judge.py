"""The verdict on one rank's slot: which deadline (if any) it has missed at time `now`.

Pure functions over a `SlotSnapshot`, so the rules are tested without processes.
Timeouts a rank learned (written into its slot) take precedence over the node config.

The slot is memory any process of the job can write, so every number is range-checked
before it is believed: a timestamp must lie between the segment's creation (`floor`)
and now, a timeout override must be 0 (use the config), +inf (not checked) or a finite
number of seconds in [MIN_LIMIT, MAX_LIMIT]. A bad timestamp skips the check that needs
it (never a hang on a number nobody could have written honestly); a bad override falls
back to the config. `problems` names the bad fields so the monitor can log them once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from stalwart.monitor.config import MonitorConfig
from stalwart.monitor.layout import SlotSnapshot, SlotState
from stalwart.monitor.reports import HangKind

#: Shortest timeout a slot may set; below it (denormals, rounding noise) it is ignored.
#: Learned timeouts of microsecond sections are legitimate, hence not higher.
MIN_LIMIT = 1e-6
#: Longest timeout a slot may set (about 31 years); use +inf to switch a check off.
MAX_LIMIT = 1e9
#: How far in the future a timestamp may lie (a write racing the scanner's clock read).
FUTURE_SLACK = 1.0
#: Two ranks' times closer than this (seconds) say nothing about which stopped first:
#: ranks that leave the same collective write their next heartbeat a few ms apart, in
#: no meaningful order, while a rank that stopped a step earlier is a whole step behind.
BLAME_RESOLUTION = 0.01


@dataclasses.dataclass(frozen=True)
class Verdict:
    kind: HangKind
    section: str | None
    timeout: float
    last_heartbeat_age: float | None
    iteration: int | None
    #: Monotonic time the rank last made progress: its last heartbeat, else its attach
    #: time. Comparable between ranks of one node (one CLOCK_MONOTONIC), not across nodes.
    stalled_since: float | None = None
    #: Monotonic time of the rank's last sign of life of any kind: a heartbeat, opening
    #: a section that is still open, or leaving its last section (`blame`'s tie-breaker).
    last_active: float | None = None


@dataclasses.dataclass(frozen=True)
class Stalled:
    """A rank found hung, as `blame` compares it with the node's other hung ranks."""

    local_rank: int
    global_rank: int
    iteration: int | None
    stalled_since: float | None
    last_active: float | None = None  # see Verdict.last_active
    stopped: bool = False  # its process was stopped (SIGSTOP) when it was found hung
    #: What its stack showed when it was found hung (monitor.evidence): True inside a
    #: collective or a wait on peers, False elsewhere, None without a stack to read.
    waiting: bool | None = None
    why: str | None = None  # that evidence in words, for the report


def _oldest(
    stalled: Sequence[Stalled], when: Callable[[Stalled], float | None], resolution: float
) -> list[Stalled]:
    """Those whose time `when` is within `resolution` of the oldest known one (all of
    them when nobody's is known); one that is not known never beats one that is."""
    known = [(t, s) for s in stalled if (t := when(s)) is not None]
    if not known:
        return list(stalled)
    first = min(t for t, _ in known)
    return [s for t, s in known if t - first <= resolution]


def _idle(s: Stalled) -> bool:
    """Nothing since its last progress: no section opened or left after it."""
    return (
        s.last_active is not None
        and s.stalled_since is not None
        and s.last_active <= s.stalled_since
    )


def blame(stalled: Sequence[Stalled], resolution: float = BLAME_RESOLUTION) -> list[Stalled]:
    """Orders hung ranks root cause first: the rank whose progress stopped first.

    When one rank stops, its peers block in the next collective and go stale a moment
    later; which slot a scan reads first says nothing. The rank behind is the cause,
    found by narrowing the candidates, each rule applied to those the previous one left:

    0. where stacks were read (`Stalled.waiting`) and some ranks wait on their peers
       while others do not, only those that do not;
    1. the lowest iteration, when every rank reports iterations (all ranks report at the
       same point of a step, so a rank one step behind is the one the others wait for);
    2. the oldest last progress (heartbeat, else attach); times within `resolution` of
       the oldest are a tie (ranks that left the same collective beat a moment apart,
       in no meaningful order);
    3. a rank whose process is stopped: it cannot be the one blocked in a collective;
    4. a rank that did nothing since its last progress, over one that opened or left a
       section since (`Verdict.last_active`): from the same point, the one that did
       more went on to the collective where it waits;
    5. the oldest last sign of life of any kind, within `resolution`;
    6. the lowest global rank: the slots cannot tell the rest apart.

    A rank whose time is not known never wins a rule over one whose time is. The root
    cause comes first; the others follow in order of iteration and last progress.
    """
    # 0. Evidence first: where stacks tell victims from the rest, the root cause is
    #    among the ranks that are not waiting on the others.
    culprits = [s for s in stalled if s.waiting is False]
    pool = culprits if culprits and len(culprits) < len(stalled) else list(stalled)
    by_iteration = all(s.iteration is not None for s in pool)

    def key(s: Stalled) -> tuple[int, int, float, int]:
        it = s.iteration if by_iteration and s.iteration is not None else 0
        since = s.stalled_since
        return (it, since is None, since if since is not None else 0.0, s.global_rank)

    order = sorted(stalled, key=key)
    if not order:
        return order
    candidates = sorted(pool, key=key)
    behind = [s for s in candidates if key(s)[0] == key(candidates[0])[0]]
    tied = _oldest(behind, lambda s: s.stalled_since, resolution)
    tied = [s for s in tied if s.stopped] or tied
    tied = [s for s in tied if _idle(s)] or tied
    tied = _oldest(tied, lambda s: s.last_active, resolution)
    root = min(tied, key=lambda s: s.global_rank)
    return [root, *(s for s in order if s is not root)]


def override_ok(value: float) -> bool:
    return value == 0.0 or value == math.inf or MIN_LIMIT <= value <= MAX_LIMIT


def timestamp_ok(value: float, floor: float, now: float) -> bool:
    """A monotonic time this attempt could have written (0 means "none")."""
    return value == 0.0 or floor <= value <= now + FUTURE_SLACK


def effective(override: float, default: float | None) -> float | None:
    """0 in the slot means "use the config"; +inf means "explicitly not checked"; anything
    out of range is ignored (the config applies)."""
    if override == 0.0 or not override_ok(override):
        return default
    if math.isinf(override):
        return None
    return override


def problems(snap: SlotSnapshot, floor: float, now: float) -> list[str]:
    """Names of the fields of an attached slot that hold numbers out of range."""
    if snap.state != SlotState.ATTACHED or snap.pid <= 0:
        return []
    bad = [
        name
        for name, value in (
            ("attach_time", snap.attach_time),
            ("last_hb", snap.last_hb),
            ("oos_start", snap.oos_start),
        )
        if not timestamp_ok(value, floor, now)
    ]
    bad += [
        name
        for name, value in (
            ("hb_initial", snap.hb_initial_override),
            ("hb", snap.hb_override),
            ("oos", snap.oos_override),
        )
        if not override_ok(value)
    ]
    count = max(0, min(snap.name_count, len(snap.open_times)))
    bad += [f"open[{i}]" for i in range(count) if not timestamp_ok(snap.open_times[i], floor, now)]
    bad += [f"limit[{i}]" for i in range(count) if not override_ok(snap.limits[i])]
    return bad


def _believable(value: float, floor: float, now: float) -> float | None:
    """The timestamp if present and believable, else None (its check is skipped)."""
    return value if value > 0 and timestamp_ok(value, floor, now) else None


@dataclasses.dataclass(frozen=True)
class _Clock:
    """One deadline a slot runs: hung (`kind`) once `limit` seconds passed since `start`."""

    kind: HangKind
    start: float
    limit: float
    section: str | None = None  # the section it times (None: a heartbeat or oos clock)


def _clocks(
    snap: SlotSnapshot, names: list[str], config: MonitorConfig, now: float, floor: float
) -> list[_Clock]:
    """The deadlines an attached slot runs, in the order `judge` checks them. A check
    whose timestamp is not believable, or whose timeout is off, runs none."""
    clocks: list[_Clock] = []
    last_hb = _believable(snap.last_hb, floor, now)
    attach = _believable(snap.attach_time, floor, now)
    if snap.last_hb == 0.0:
        limit = effective(snap.hb_initial_override, config.effective_initial_timeout)
        if limit is not None and attach is not None:
            clocks.append(_Clock(HangKind.INITIAL_HEARTBEAT, attach, limit))
    elif last_hb is not None:
        limit = effective(snap.hb_override, config.hb_timeout)
        if limit is not None:
            clocks.append(_Clock(HangKind.HEARTBEAT, last_hb, limit))

    any_open = False
    for idx in range(max(0, min(snap.name_count, len(names)))):
        raw = snap.open_times[idx]
        if raw == 0.0:
            continue
        # An unbelievable open time still means "some section is open" for the
        # out-of-section clock; only its own check is skipped.
        any_open = True
        opened = _believable(raw, floor, now)
        limit = effective(snap.limits[idx], config.section_timeouts.get(names[idx]))
        if opened is not None and limit is not None:
            clocks.append(_Clock(HangKind.SECTION, opened, limit, names[idx]))

    oos_start = _believable(snap.oos_start, floor, now)
    if not any_open and oos_start is not None:
        limit = effective(snap.oos_override, config.out_of_section_timeout)
        if limit is not None:
            clocks.append(_Clock(HangKind.OUT_OF_SECTION, oos_start, limit))
    return clocks


def last_active(snap: SlotSnapshot, floor: float, now: float) -> float | None:
    """The slot's last sign of life of any kind: its last heartbeat or attach, opening a
    section that is still open, leaving its last section (believable times only)."""
    count = max(0, min(snap.name_count, len(snap.open_times)))
    times = [snap.attach_time, snap.last_hb, snap.oos_start, *snap.open_times[:count]]
    known = [t for t in times if _believable(t, floor, now) is not None]
    return max(known) if known else None


def _live_clocks(
    snap: SlotSnapshot, names: list[str], config: MonitorConfig, now: float, floor: float
) -> list[_Clock]:
    """`_clocks` of a slot attached by a writer; none for any other slot."""
    if snap.state != SlotState.ATTACHED or snap.pid <= 0:
        return []
    return _clocks(snap, names, config, now, floor)


def _judged(
    snap: SlotSnapshot,
    names: list[str],
    config: MonitorConfig,
    now: float,
    floor: float,
    early: bool,
) -> Verdict | None:
    """The verdict of the first clock past its deadline, in `_clocks`' order; with
    `early`, else that of the clock nearest its deadline (None: no clock runs)."""
    clocks = _live_clocks(snap, names, config, now, floor)
    clock = next((c for c in clocks if now - c.start > c.limit), None)
    if clock is None and early and clocks:
        clock = min(clocks, key=lambda c: c.start + c.limit)
    return None if clock is None else _verdict(snap, names, clock, now, floor)


def judge(
    snap: SlotSnapshot,
    names: list[str],
    config: MonitorConfig,
    now: float,
    floor: float = 0.0,
) -> Verdict | None:
    """The deadline the slot has missed at `now` (None: none)."""
    return _judged(snap, names, config, now, floor, early=False)


def judged_early(
    snap: SlotSnapshot,
    names: list[str],
    config: MonitorConfig,
    now: float,
    floor: float = 0.0,
) -> Verdict | None:
    """The verdict on a rank judged together with a culprit before its own deadline
    passed (a victim waiting on it): that of the clock nearest its deadline, as it reads
    at `now`, so the report shows its real age, not the limit. `judge`'s verdict when a
    deadline has already passed; None when no deadline runs."""
    return _judged(snap, names, config, now, floor, early=True)


def _verdict(
    snap: SlotSnapshot, names: list[str], clock: _Clock, now: float, floor: float
) -> Verdict:
    last_hb = _believable(snap.last_hb, floor, now)
    last_section = names[snap.last_section] if 0 <= snap.last_section < len(names) else None
    return Verdict(
        clock.kind,
        clock.section if clock.kind is HangKind.SECTION else last_section,
        clock.limit,
        now - last_hb if last_hb is not None else None,
        snap.iteration if snap.iteration >= 0 else None,
        last_hb if last_hb is not None else _believable(snap.attach_time, floor, now),
        last_active(snap, floor, now),
    )


def next_deadline(
    snap: SlotSnapshot,
    names: list[str],
    config: MonitorConfig,
    now: float,
    floor: float = 0.0,
) -> float | None:
    """The earliest monotonic time at which `judge` would find this slot hung if it
    stays as it is (None: no deadline runs), so that the scanner can look then rather
    than up to a check interval later. Reads the same clocks as `judge`."""
    due = [clock.start + clock.limit for clock in _live_clocks(snap, names, config, now, floor)]
    return min(due) if due else None


#: The first evidence look is never taken before a rank was silent for this share of the
#: deadline it runs. A learned timeout is `MonitorConfig.safety_factor` (5) times the
#: longest gap seen, so half of it is already late by the rank's rhythm, while a rank
#: that has just stepped is neither sampled nor asked for its stacks.
LOOK_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Lookout:
    """When the evidence cycle looks at a slot that stays as it is (monotonic times)."""

    #: Start of the earliest deadline's clock: the rank's last progress (heartbeat,
    #: attach, a section opened or left). A look taken while it read otherwise saw
    #: another stall and is worth nothing.
    since: float
    look: float  # the first look: `lead` before the deadline, once the rank is late
    due: float  # the deadline itself: no hang is decided before it


def lookout(
    snap: SlotSnapshot,
    names: list[str],
    config: MonitorConfig,
    now: float,
    floor: float,
    lead: float,
) -> Lookout | None:
    """When to take the first of the two looks that confirm a hang (None: no deadline
    runs): `lead` (the looks' spacing) before the earliest deadline, so the second look
    falls on the deadline and a hung rank is decided there instead of a window after it;
    never before the rank was silent for `LOOK_SHARE` of that deadline. Reads the same
    clocks as `judge` and `next_deadline`."""
    clocks = _live_clocks(snap, names, config, now, floor)
    if not clocks:
        return None
    clock = min(clocks, key=lambda c: c.start + c.limit)
    ahead = max(clock.limit - max(lead, 0.0), clock.limit * LOOK_SHARE)
    return Lookout(clock.start, clock.start + ahead, clock.start + clock.limit)


def stragglers(step_times: dict[int, float], factor: float) -> dict[int, float]:
    """Ranks whose seconds per step are at least `factor` x the median of the others'.

    step_times: rank -> its seconds per step over the same window (ranks that made no
    progress are left out: that is for the hang checks). Returns rank -> ratio. Needs
    two ranks at least; compared with the median of the *others*, so one slow rank of
    two is still named, and a slow rank does not raise the bar it is measured against.
    """
    out: dict[int, float] = {}
    if len(step_times) < 2:
        return out
    for rank, mine in step_times.items():
        others = sorted(v for r, v in step_times.items() if r != rank)
        mid = len(others) // 2
        median = others[mid] if len(others) % 2 else (others[mid - 1] + others[mid]) / 2
        if median > 0 and mine / median >= factor:
            out[rank] = mine / median
    return out
