"""Timeouts learned with ``auto``: the config a rank is judged by, and the node's record.

`Learning` owns what ``auto`` learns on this node: each rank's rhythm (this attempt)
and the node's learned timeouts. The scanner shows it each slot it reads (`judged_by`
answers with the config to judge that slot by, a pure function of the rhythm and the
learned values) and asks it to fold what warmed-up ranks showed (`update`); the job-sync
part folds the other nodes' values in (`fold`). Both only ever raise a timeout, and
every change is kept in the run folder (read back at start, so it survives a restart)
and logged as `timeouts_learned`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from stalwart.base.events import Event
from stalwart.base.files import replace_file
from stalwart.monitor import auto, jobsync
from stalwart.monitor.config import MonitorConfig
from stalwart.monitor.layout import SlotSnapshot
from stalwart.monitor.learned import LearnedTimeouts
from stalwart.monitor.node_state import LogEvent

log = logging.getLogger(__name__)

#: Largest learned-timeouts file read back from the run folder.
MAX_LEARNED_BYTES = jobsync.MAX_VALUE_BYTES


def auto_settings(config: MonitorConfig) -> auto.AutoSettings:
    return auto.AutoSettings(
        hb=config.hb_auto,
        sections=config.section_auto,
        oos=config.oos_auto,
        warmup_steps=config.auto_warmup_steps,
        warmup_seconds=config.auto_warmup_seconds,
        percentile=config.auto_percentile,
        factor=config.safety_factor,
        floor=config.auto_floor,
    )


def config_for(
    c: MonitorConfig,
    a: auto.AutoSettings,
    learned: LearnedTimeouts,
    rhythm: auto.Rhythm,
    now: float,
) -> MonitorConfig:
    """The config a rank is judged by: learned values once it warmed up, the initial
    timeout before; numbers the user gave stay as they are (`a`: `auto_settings(c)`)."""
    # A rhythm already learned (an earlier attempt, or an earlier run in this run
    # folder) judges a rank from its first step on; only a first one warms up.
    warm = rhythm.warm(a.warmup_steps, a.warmup_seconds, now) or (
        learned.hb is not None and rhythm.beats >= 1 and not rhythm.relearning
    )
    pre = c.auto_initial_timeout
    hb = c.hb_timeout
    if a.hb:
        hb = learned.hb if warm and learned.hb is not None else pre
    oos = c.out_of_section_timeout
    if a.oos:
        oos = learned.oos if warm and learned.oos is not None else pre
    sections = dict(c.section_timeouts)
    if a.sections:
        for name in rhythm.names:
            if name not in sections:
                value = learned.sections.get(name)
                sections[name] = value if warm and value is not None else pre
    initial = c.effective_initial_timeout
    if hb is not None and initial is not None and initial < hb:
        initial = hb
    return dataclasses.replace(
        c,
        hb_timeout=hb,
        hb_initial_timeout=initial,
        out_of_section_timeout=oos,
        section_timeouts=sections,
    )


class Learning:
    """The learned timeouts of one node monitor (only made use of with ``auto``)."""

    def __init__(
        self,
        config: MonitorConfig,
        path: Path | None,
        emit: LogEvent,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        """path: where the node's learned timeouts are kept (None: nowhere); on_change:
        called after the scanner learned something new (the job hears of it sooner)."""
        self.config = config
        self._auto = auto_settings(config)
        self._path = path
        self._emit = emit
        self._on_change = on_change
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()  # one writer of the learned-timeouts file
        self._learned = LearnedTimeouts()
        self._rhythms: dict[int, auto.Rhythm] = {}  # local rank -> this attempt's rhythm

    @property
    def current(self) -> LearnedTimeouts:
        with self._lock:
            return self._learned

    def new_attempt(self) -> None:
        with self._lock:
            self._rhythms = {}

    def judged_by(
        self, local_rank: int, snap: SlotSnapshot, names: list[str], now: float
    ) -> MonitorConfig:
        """Takes in one read of a rank's slot; the config to judge that read by."""
        a = self._auto
        with self._lock:
            rhythm = self._rhythms.get(local_rank)
            if rhythm is None:
                rhythm = self._rhythms[local_rank] = auto.Rhythm(settle=a.warmup_steps // 2)
            learned = self._learned
        warm = rhythm.warm(a.warmup_steps, a.warmup_seconds, now)
        if rhythm.observe(snap, names, now, relearn=warm):
            log.info("rank %d opened a new section: learning its rhythm again", local_rank)
        return config_for(self.config, a, learned, rhythm, now)

    def update(self) -> None:
        """Folds what warmed-up ranks showed into the node's learned timeouts (they only
        grow: a slow step seen once stays allowed); persists and logs a change."""
        a = self._auto
        now = time.monotonic()
        with self._lock:
            warm = [
                r for r in self._rhythms.values() if r.warm(a.warmup_steps, a.warmup_seconds, now)
            ]
        if warm and self.fold(auto.from_rhythms(warm, a), "observed"):
            self._on_change()

    def fold(self, values: LearnedTimeouts, source: str) -> bool:
        """Takes the maximum of the node's learned timeouts and `values`; on a change,
        keeps it in the run folder and logs `timeouts_learned`. True on a change.

        The scanner (observed values) and the job's sync thread (other nodes' values)
        both come here; the file is written by one at a time, always the latest."""
        values, raised = jobsync.at_least(values, self._auto.floor)
        if raised:
            log.warning(
                "learned timeouts from %s below the floor of %g s raised to it: %s",
                source,
                self._auto.floor,
                ", ".join(raised),
            )
        with self._file_lock:
            with self._lock:
                merged = auto.merge(self._learned, values)
                if merged == self._learned:
                    return False
                self._learned = merged
            self._write(merged)
            self._emit(Event.TIMEOUTS_LEARNED, {"source": source, **merged.to_state()})
        return True

    def read(self) -> None:
        """Folds in what the run folder kept from an earlier monitor of this run."""
        path = self._path
        if path is None:
            return
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_LEARNED_BYTES + 1)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("could not read learned timeouts %s: %s", path, exc)
            return
        try:
            learned = jobsync.decode_learned(raw)
        except ValueError as exc:
            log.warning("ignoring learned timeouts in %s: %s", path, exc)
            return
        self.fold(learned, str(path))

    def _write(self, learned: LearnedTimeouts) -> None:
        path = self._path
        if path is None:
            return
        try:
            replace_file(path, json.dumps(learned.to_state(), sort_keys=True).encode())
        except OSError as exc:
            log.warning("could not keep learned timeouts in %s: %s", path, exc)
