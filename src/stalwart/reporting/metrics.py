"""``--metrics-port``: the launcher serves ``/metrics`` for Prometheus.

Every number is derived from the run's ``events.jsonl`` (the launcher's lines and the
workers'), read incrementally at each scrape, so the metrics say what the event log,
the closing block and ``stalwart report`` say.  The goodput figures are
``goodput.account`` of the events so far, with the run ending "now".
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from stalwart.base.events import Event
from stalwart.base.records import EVENT_LINE_LIMIT
from stalwart.reporting.event_schema import BadRecord, parse_event_line
from stalwart.reporting.goodput import CATEGORIES, account
from stalwart.reporting.metrics_http import RateLimitedLog, serve

logger = logging.getLogger(__name__)

#: Bytes of the events file read at a time (a scrape reads what is new, chunk by chunk).
READ_CHUNK = 1 << 20

# Save latency buckets (s): staging a few MiB to writing tens of GiB.
SAVE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RunState:
    """What the metrics need from the events, folded in one event at a time.

    Progress events are thinned to the first and latest per (attempt, rank): enough for
    the live accounting, and a week-long run does not grow the launcher's memory.
    """

    def __init__(self) -> None:
        self.restarts = 0
        self.failures: dict[str, int] = {}
        self.hangs: dict[str, int] = {}
        self.attempt = -1
        self.world_size = 0
        self.step = -1
        self.step_rate = 0.0
        self.saves: list[float] = []
        self.newest_commit: float | None = None
        self.quarantines = 0
        self.quarantined: set[str] = set()
        self._kept: list[dict[str, Any]] = []
        self._progress: dict[tuple[int, int], tuple[dict[str, Any], dict[str, Any]]] = {}
        self._rate_from: tuple[float, int] | None = None

    def fold(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        if kind == Event.PROGRESS:
            key = (_int(ev.get("attempt"), -1), _int(ev.get("local_rank"), 0))
            first = self._progress.get(key, (ev, ev))[0]
            self._progress[key] = (first, ev)
            self._step(ev)
            return
        self._kept.append(ev)
        if kind == Event.RESTART:
            self.restarts += 1
        elif kind == Event.WORKER_EXIT and ev.get("exitcode") not in (0, None):
            why = ev.get("signal") or "exit"
            self.failures[why] = self.failures.get(why, 0) + 1
        elif kind == Event.HANG_DETECTED:
            why = str(ev.get("kind") or "unknown")
            self.hangs[why] = self.hangs.get(why, 0) + 1
        elif kind == Event.NODE_QUARANTINED and isinstance(ev.get("node"), str):
            self.quarantines += 1
            self.quarantined.add(ev["node"])
        elif kind == Event.NODE_RELEASED and isinstance(ev.get("node"), str):
            self.quarantined.discard(ev["node"])
        elif kind == Event.RENDEZVOUS_DONE:
            self.attempt = _int(ev.get("attempt"), self.attempt)
            self.world_size = int(ev.get("world_size") or 0)
            self._rate_from = None
        elif kind == Event.CHECKPOINT_COMMIT and ev.get("rank") in (None, 0):
            self.newest_commit = float(ev["time"])
            if isinstance(ev.get("save_s"), int | float):
                self.saves.append(float(ev["save_s"]))

    def _step(self, ev: dict[str, Any]) -> None:
        if ev.get("attempt") != self.attempt or not isinstance(ev.get("step"), int):
            return
        step, at = int(ev["step"]), float(ev.get("step_time") or ev["time"])
        if step <= self.step:
            return
        self.step = step
        if self._rate_from is None:
            self._rate_from = (at, step)
        elif at > self._rate_from[0]:
            self.step_rate = (step - self._rate_from[1]) / (at - self._rate_from[0])

    def events(self) -> list[dict[str, Any]]:
        thin = [e for pair in self._progress.values() for e in {id(p): p for p in pair}.values()]
        return sorted([*self._kept, *thin], key=lambda e: float(e["time"]))


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


class RunCollector(Collector):
    """Reads new lines of the events file at each scrape and reports the run.

    Only records that ``records.parse_event_line`` accepts are folded in: a line a
    worker (or anyone) wrote wrong is skipped with a rate-limited warning, and the
    metrics stay what the good lines say."""

    def __init__(self, path: Path | None, start: int = 0) -> None:
        self.path = path
        self.state = RunState()
        self._offset = start
        self._partial = b""
        self._overlong = False  # inside a line too long to keep: skip to its end
        self._lock = threading.Lock()
        self.skipped = 0
        self._warn = RateLimitedLog(logger)

    def watch(self, path: Path | None, start: int) -> None:
        with self._lock:
            self.path, self._offset, self._partial = path, start, b""

    def _read_new(self) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                while data := fh.read(READ_CHUNK):
                    self._offset += len(data)
                    self._feed(data)
        except FileNotFoundError:
            return

    def _feed(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # a line still being written
        for raw in lines:
            if self._overlong:
                self._overlong = False  # the end of the long line: skipped
                continue
            if raw.strip():
                self._fold(raw)
        if len(self._partial) > EVENT_LINE_LIMIT:
            self._partial = b""
            self._overlong = True
            self._bad(f"a line of more than {EVENT_LINE_LIMIT} bytes")

    def _fold(self, raw: bytes) -> None:
        try:
            ev = parse_event_line(raw)
        except BadRecord as err:
            self._bad(str(err))
            return
        self.state.fold(ev)

    def _bad(self, why: str) -> None:
        self.skipped += 1
        self._warn.warning(f"metrics: skipped a malformed line of {self.path}: {why}")

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self._read_new()
            s = self.state
            yield from _families(s, time.time())


def _families(s: RunState, now: float) -> Iterator[Metric]:
    c = CounterMetricFamily("stalwart_restarts", "Restarts of the job after a failure")
    c.add_metric([], s.restarts)
    yield c
    c = CounterMetricFamily(
        "stalwart_worker_failures", "Workers that ended badly, by kind", labels=["kind"]
    )
    for kind, n in sorted(s.failures.items()):
        c.add_metric([kind], n)
    yield c
    c = CounterMetricFamily(
        "stalwart_hangs_detected", "Hung ranks the monitor stopped, by kind", labels=["kind"]
    )
    for kind, n in sorted(s.hangs.items()):
        c.add_metric([kind], n)
    yield c
    c = CounterMetricFamily(
        "stalwart_node_quarantines", "Nodes quarantined for failing K of the last M rounds"
    )
    c.add_metric([], s.quarantines)
    yield c
    yield GaugeMetricFamily(
        "stalwart_nodes_quarantined", "Nodes kept out of the job now", len(s.quarantined)
    )
    yield GaugeMetricFamily("stalwart_attempt", "Current attempt (restart count)", s.attempt)
    yield GaugeMetricFamily("stalwart_world_size", "Workers in the current attempt", s.world_size)
    yield GaugeMetricFamily("stalwart_step", "Latest training step reported", s.step)
    yield GaugeMetricFamily(
        "stalwart_steps_per_second", "Training steps per second in this attempt", s.step_rate
    )
    b = account(s.events(), now=now)
    yield GaugeMetricFamily(
        "stalwart_goodput_ratio", "Productive share of the wall-clock time so far", b.goodput
    )
    yield GaugeMetricFamily(
        "stalwart_productive_seconds", "Seconds of kept training so far", b.seconds["productive"]
    )
    g = GaugeMetricFamily(
        "stalwart_lost_seconds", "Seconds not spent on kept training, by cause", labels=["cause"]
    )
    for cat in CATEGORIES[1:]:
        g.add_metric([cat], b.seconds[cat])
    yield g
    buckets: list[tuple[str, float]] = [
        (str(le), float(sum(1 for x in s.saves if x <= le))) for le in SAVE_BUCKETS
    ]
    buckets.append(("+Inf", float(len(s.saves))))
    h = HistogramMetricFamily(
        "stalwart_checkpoint_save_seconds", "Time from save() to the share's commit (rank 0)"
    )
    h.add_metric([], buckets, sum(s.saves))
    yield h
    if s.newest_commit is not None:
        yield GaugeMetricFamily(
            "stalwart_checkpoint_age_seconds",
            "Age of the newest committed checkpoint",
            now - s.newest_commit,
        )


class MetricsPortError(ValueError):
    """The port cannot be served (taken, or not allowed): a one-line message."""


class MetricsServer:
    """The HTTP endpoint; binding happens at construction, so a taken port fails early."""

    def __init__(self, port: int, addr: str) -> None:
        self.collector = RunCollector(None)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        try:
            self._server, self._thread = serve(port, addr, self.registry)
        except OSError as err:
            why = "already in use" if err.errno == errno.EADDRINUSE else os.strerror(err.errno or 0)
            raise MetricsPortError(f"--metrics-port {port}: {addr}:{port} is {why}") from None

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def watch(self, events: Path | None, start: int = 0) -> None:
        """Reads *events* from byte *start*: this run's part of a reused run folder."""
        self.collector.watch(events, start)

    def close(self) -> None:
        self._server.close()
        self._thread.join(timeout=5)
