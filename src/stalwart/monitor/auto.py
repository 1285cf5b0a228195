"""Timeouts learned by the node monitor itself (`--hb-timeout auto` and friends).

The scanner already reads every rank's slot each `check_interval`; `Rhythm` keeps what
those reads show about one rank of one attempt: the gaps between the heartbeats it saw
change, how long each section was seen open, how long the rank stayed out of sections.
A scan misses the beats between two reads, so an observed gap may cover several real
gaps. Where the slot's heartbeat count says how many (k), the sample is the longest
those k gaps can have been given the shortest gap ever seen alone (`longest_gap`), not
the whole stretch: with steps shorter than the check interval the stretch is about the
check interval, and the timeout learned from it would be set by how often the monitor
looks, not by the job. Without a count the whole stretch is the sample (the long side).

`learn` (pure) turns samples into a timeout: a percentile (100 = the maximum) times the
safety factor, never below the floor. `AutoLearner` holds the node's learned values:
the maximum over its ranks and over earlier attempts (a slow step seen once is not
forgotten at a restart), and applies them to a rank only once that rank has warmed up
in the current attempt; before that the initial timeout applies. The first half of a
rank's warm-up is not learned from (start-up, first compilations, a first checkpoint's
set-up would otherwise set the timeout for the whole run). A section name a rank
opens for the first time after warm-up (a first checkpoint, an evaluation phase) sends
that rank back to warm-up, so its slow stretch is learned instead of judged.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Sequence

from stalwart.monitor.layout import SlotSnapshot
from stalwart.monitor.learned import LearnedTimeouts

#: Samples kept per rank and kind: enough for a high percentile, bounded memory.
MAX_SAMPLES = 4096
#: Gaps a beating rank must have shown before it counts as warmed up.
MIN_GAP_SAMPLES = 3
#: More heartbeats than this between two reads of a slot is taken for a scribble.
MAX_BEATS_PER_READ = 100_000


def learn(samples: Sequence[float], percentile: float, factor: float, floor: float) -> float | None:
    """The timeout `samples` (seconds) call for; None without samples.

    percentile in (0, 100]: nearest-rank percentile, 100 is the maximum.
    """
    if not samples:
        return None
    ordered = sorted(samples)
    rank = max(1, math.ceil(percentile / 100.0 * len(ordered)))
    return max(floor, ordered[min(rank, len(ordered)) - 1] * factor)


def longest_gap(total: float, beats: int, shortest: float | None) -> float:
    """The longest of `beats` consecutive heartbeat gaps that add up to `total`: each of
    the others lasted at least `shortest` (the shortest gap seen on its own), and the
    longest is at least their mean. Without a known shortest gap, `total` itself."""
    if beats <= 1 or shortest is None:
        return total
    return max(total / beats, total - (beats - 1) * shortest)


def _bounded() -> deque[float]:
    return deque(maxlen=MAX_SAMPLES)


@dataclasses.dataclass
class Rhythm:
    """What the scans of one rank (one attempt) have seen."""

    beats: int = 0  # steps (iterations, else heartbeats) since warm-up (re)started
    warm_since: float | None = None  # monotonic time warm-up (re)started
    last_hb: float = 0.0
    last_iteration: int = -1
    last_count: int = 0  # the slot's heartbeat count at the last change seen
    shortest: float | None = None  # the shortest gap seen with one beat between reads
    # Steps at the start whose intervals are not learned (process start-up, first
    # compilations, a first checkpoint's set-up): half the warm-up.
    settle: int = 0
    hb_gaps: deque[float] = dataclasses.field(default_factory=_bounded)
    open_seen: dict[str, float] = dataclasses.field(default_factory=dict)
    sections: dict[str, deque[float]] = dataclasses.field(default_factory=dict)
    names: set[str] = dataclasses.field(default_factory=set)
    oos_seen: float = 0.0
    oos: deque[float] = dataclasses.field(default_factory=_bounded)
    relearning: bool = False  # a new section sent it back to warm-up

    def observe(self, snap: SlotSnapshot, names: list[str], now: float, relearn: bool) -> bool:
        """Takes in one read of the slot; True when a section name appeared that had not
        been seen before and `relearn` (the rank is warm) asked for that to restart
        warm-up. Names present from the start are the rank's rhythm, not a change."""
        if self.warm_since is None:
            self.warm_since = now
        learning = self.beats >= self.settle
        if snap.last_hb > 0 and snap.last_hb != self.last_hb:
            counted = 0 < snap.beats - self.last_count <= MAX_BEATS_PER_READ and self.last_count > 0
            stepped = (
                snap.iteration - self.last_iteration
                if 0 <= self.last_iteration < snap.iteration
                and snap.iteration - self.last_iteration <= MAX_BEATS_PER_READ
                else 0
            )
            if self.last_hb > 0 and snap.last_hb > self.last_hb:
                gap = snap.last_hb - self.last_hb
                # Beats between the reads: the slot's count, else the steps (a rank whose
                # steps are seen without code beats once per step and counts none).
                between = snap.beats - self.last_count if counted else stepped
                if between == 1:
                    self.shortest = gap if self.shortest is None else min(self.shortest, gap)
                if learning:
                    sample = longest_gap(gap, between, self.shortest) if between else gap
                    self.hb_gaps.append(sample)
            self.last_hb = snap.last_hb
            # Several beats may fall between two reads: count steps where they are known
            # (iterations, else the slot's heartbeat count; a count that went backwards or
            # jumped absurdly, as anything in the slot can, counts as one).
            if stepped:
                advanced = stepped
            elif counted:
                advanced = snap.beats - self.last_count
            else:
                advanced = 1
            self.beats += advanced
        if snap.iteration >= 0:
            self.last_iteration = snap.iteration
        if snap.beats > 0:
            self.last_count = snap.beats
        any_open = False
        for idx, name in enumerate(names[: len(snap.open_times)]):
            opened = snap.open_times[idx]
            seen = self.open_seen.get(name)
            if seen is not None and opened != seen:
                # Closed (or closed and reopened) since the last read: it lasted at most
                # until now, an upper bound.
                if learning:
                    self.sections.setdefault(name, _bounded()).append(max(0.0, now - seen))
                del self.open_seen[name]
            if opened > 0:
                any_open = True
                self.open_seen.setdefault(name, opened)
        if any_open or snap.oos_start != self.oos_seen:
            if self.oos_seen > 0 and learning:
                self.oos.append(max(0.0, now - self.oos_seen))
            self.oos_seen = 0.0 if any_open else snap.oos_start
        new = [n for n in names if n not in self.names]
        self.names.update(new)
        if new and relearn:
            # The new stretch is what must be learned: nothing is skipped this time.
            self.relearning = True
            self.beats = 0
            self.settle = 0
            self.warm_since = now
            return True
        return False

    def warm(self, steps: int, seconds: float, now: float) -> bool:
        # Short steps pass many at a time between two reads: the steps alone could be
        # done before a single gap was learned from.
        return (
            self.beats >= steps
            and self.warm_since is not None
            and now - self.warm_since >= seconds
            and (self.last_hb == 0.0 or len(self.hb_gaps) >= MIN_GAP_SAMPLES)
        )


@dataclasses.dataclass(frozen=True)
class AutoSettings:
    hb: bool
    sections: bool
    oos: bool
    warmup_steps: int
    warmup_seconds: float
    percentile: float
    factor: float
    floor: float


def merge(a: LearnedTimeouts, b: LearnedTimeouts) -> LearnedTimeouts:
    """The larger of two sets of learned timeouts, field by field."""

    def mx(x: float | None, y: float | None) -> float | None:
        vals = [v for v in (x, y) if v is not None]
        return max(vals) if vals else None

    names = set(a.sections) | set(b.sections)
    return LearnedTimeouts(
        hb_initial=None,
        hb=mx(a.hb, b.hb),
        sections={n: v for n in sorted(names) if (v := mx(a.sections.get(n), b.sections.get(n)))},
        oos=mx(a.oos, b.oos),
    )


def from_rhythms(rhythms: Iterable[Rhythm], s: AutoSettings) -> LearnedTimeouts:
    """Learned timeouts from the warmed-up ranks' samples, pooled over the ranks."""
    pool = list(rhythms)
    hb = [g for r in pool for g in r.hb_gaps]
    oos = [g for r in pool for g in r.oos]
    names = {n for r in pool for n in r.sections}
    sections: dict[str, float] = {}
    if s.sections:
        for n in sorted(names):
            value = learn([d for r in pool for d in r.sections.get(n, ())], *_knobs(s))
            if value is not None:
                sections[n] = value
    return LearnedTimeouts(
        hb=learn(hb, *_knobs(s)) if s.hb else None,
        sections=sections,
        oos=learn(oos, *_knobs(s)) if s.oos else None,
    )


def _knobs(s: AutoSettings) -> tuple[float, float, float]:
    return s.percentile, s.factor, s.floor
