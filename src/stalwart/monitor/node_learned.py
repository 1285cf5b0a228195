"""Timeouts learned with ``auto``: the config a rank is judged by, and the node's record.

The scanner folds what warmed-up ranks showed into the node's learned timeouts; the
job-sync thread folds the other nodes' values in. Both only ever raise a timeout, and
every change is kept in the run folder (read back at start, so it survives a restart)
and logged as `timeouts_learned`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

from stalwart.base.events import Event
from stalwart.base.files import replace_file
from stalwart.monitor import auto, jobsync
from stalwart.monitor.config import MonitorConfig
from stalwart.monitor.learned import LearnedTimeouts
from stalwart.monitor.node_state import NodeState

log = logging.getLogger(__name__)

#: Largest learned-timeouts file read back from the run folder.
MAX_LEARNED_BYTES = jobsync.MAX_VALUE_BYTES


class NodeLearning(NodeState):
    """Learned (auto) timeouts of a node monitor."""

    def _config_for(self, rhythm: auto.Rhythm, now: float) -> MonitorConfig:
        """The config a rank is judged by: learned values once it warmed up, the initial
        timeout before; numbers the user gave stay as they are."""
        c, a = self.config, self._auto
        warm = rhythm.warm(a.warmup_steps, a.warmup_seconds, now)
        pre = c.auto_initial_timeout
        learned = self._learned
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

    def _update_learned(self) -> None:
        """Folds what warmed-up ranks showed into the node's learned timeouts (they only
        grow: a slow step seen once stays allowed); persists and logs a change."""
        a = self._auto
        now = time.monotonic()
        with self._lock:
            warm = [
                r for r in self._rhythms.values() if r.warm(a.warmup_steps, a.warmup_seconds, now)
            ]
        if warm and self._fold_learned(auto.from_rhythms(warm, a), "observed"):
            self._sync_wake.set()  # the other nodes hear of it without waiting a poll

    def _fold_learned(self, values: LearnedTimeouts, source: str) -> bool:
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
        with self._learned_lock:
            with self._lock:
                merged = auto.merge(self._learned, values)
                if merged == self._learned:
                    return False
                self._learned = merged
            self._write_learned(merged)
            self._emit(Event.TIMEOUTS_LEARNED, {"source": source, **merged.to_state()})
        return True

    def _read_learned(self) -> None:
        path = self._learned_path
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
        self._fold_learned(learned, str(path))

    def _write_learned(self, learned: LearnedTimeouts) -> None:
        path = self._learned_path
        if path is None:
            return
        try:
            replace_file(path, json.dumps(learned.to_state(), sort_keys=True).encode())
        except OSError as exc:
            log.warning("could not keep learned timeouts in %s: %s", path, exc)
