"""The sync thread: a node monitor's share of the job's store.

`JobSync` owns the node's membership of the job (the round's `JobPeers`) and the sync
thread. Through `JobPeers.store` (see `monitor.jobsync` for the keys and encodings) it
publishes this node's learned timeouts (from the `Learning` part) and straggler windows
(handed over by `offer`), reads the other nodes', folds their learned timeouts into
`Learning` and hands the job's straggler verdicts to the `StragglerWatch`. A lost store
is logged once per key and left to the supervisor.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgspec

from stalwart.monitor import auto, jobsync
from stalwart.monitor.config import MonitorConfig
from stalwart.monitor.jobsync import JobPeers, NodeRhythm
from stalwart.monitor.judge import stragglers
from stalwart.monitor.learned import LearnedTimeouts
from stalwart.monitor.node_learned import Learning
from stalwart.monitor.node_state import Window
from stalwart.monitor.node_stragglers import StragglerWatch

log = logging.getLogger(__name__)


class JobSync:
    """This node's exchange with the job's other nodes, on a thread of its own."""

    def __init__(self, config: MonitorConfig, learning: Learning, watch: StragglerWatch) -> None:
        self.config = config
        self._learning = learning
        self._watch = watch
        self._lock = threading.Lock()
        self._peers: JobPeers | None = None
        self._window: Window | None = None  # the last window offered, for the sync thread
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # Sync thread only: the round it shares in, what the job's store is known to hold
        # in it (ours and others' values; ours is published only when it adds to that),
        # and the store's change counter when last read.
        self._round: int | None = None
        self._job_known = LearnedTimeouts()
        self._seen_version = -1
        self._window_seq = 0
        self._freshness = jobsync.Freshness(2 * config.straggler_window)
        self._warned: set[str] = set()

    def start(self) -> None:
        self._stop.clear()

    def join(self, peers: JobPeers | None) -> None:
        """The job's other nodes for the round about to start; None, or a one-node
        round: nothing is shared."""
        if peers is not None and peers.nnodes < 2:
            peers = None
        with self._lock:
            self._peers = peers
            self._window = None
            starts = peers is not None and self._thread is None and not self._stop.is_set()
            if starts:
                self._thread = threading.Thread(
                    target=self._loop, name="stalwart-monitor-sync", daemon=True
                )
        if starts and self._thread is not None:
            self._thread.start()
        self._wake.set()

    def offer(self, window: Window) -> bool:
        """Hands a straggler window over to be compared with the job's; False when the
        node is alone in its round (the caller compares it)."""
        with self._lock:
            if self._peers is None:
                return False
            self._window = window
        self._wake.set()
        return True

    def wake(self) -> None:
        """Shares without waiting for the next poll (something changed)."""
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            # A store call that hangs is bounded by the store's own timeout; the thread
            # is a daemon and cannot hold the launcher's exit.
            thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                peers = self._peers
            if peers is not None:
                try:
                    self.sync_once(peers)
                except Exception as exc:  # a lost store is the supervisor's to act on
                    self._warn("store", "could not share monitor state with the job: %s", exc)
            self._wake.wait(jobsync.SYNC_EVERY)
            self._wake.clear()

    def _warn(self, key: str, fmt: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(fmt, *args)

    def sync_once(self, peers: JobPeers) -> None:
        """One poll of the job's store (the sync thread's; tests call it directly)."""
        if peers.round != self._round:  # a new round's keys: publish again, read again
            self._round, self._job_known, self._seen_version = (
                peers.round,
                LearnedTimeouts(),
                -1,
            )
            self._window_seq = 0
            # Two windows without news: that node is not compared with any more.
            self._freshness = jobsync.Freshness(2 * self.config.straggler_window)
        if self.config.any_auto:
            self._sync_learned(peers)
        with self._lock:
            window, self._window = self._window, None
        if window is not None:
            self._sync_window(peers, window)

    def _sync_window(self, peers: JobPeers, window: Window) -> None:
        """Publishes this node's straggler window, compares it with the other nodes'
        latest ones, and names this node's stragglers. A window in which no rank of
        this node moved (finished, or hung: the hang checks' business) is not published:
        the others keep comparing with the last one that measured something."""
        store, r = peers.store, peers.round
        if not window.rhythm.step_times:
            return
        self._window_seq += 1
        mine = msgspec.structs.replace(window.rhythm, seq=self._window_seq)
        store.set(jobsync.rhythm_key(r, peers.node_rank), mine.encode())
        nodes = [n for n in range(peers.nnodes) if n != peers.node_rank]
        keys = [jobsync.rhythm_key(r, n) for n in nodes]
        others: list[tuple[int, NodeRhythm]] = []
        now = time.monotonic()
        for node, key, raw in zip(nodes, keys, store.get_many(keys), strict=True):
            if raw is None:
                continue
            try:
                other = jobsync.decode_rhythm(raw)
                if self._freshness.fresh(node, other.seq, now):
                    others.append((node, other))
            except ValueError as exc:
                self._warn(key, "ignoring a straggler window at store key %s: %s", key, exc)
        steps, hosts = jobsync.pool_rhythms(window.rhythm, peers.node_rank, others)
        verdicts = stragglers(steps, self.config.straggler_factor)
        self._watch.report(verdicts, steps, hosts, window, peers, 1 + len(others))

    def _sync_learned(self, peers: JobPeers) -> None:
        """Publishes this node's learned timeouts when they changed; reads the others'
        when any changed (one counter read per poll otherwise) and applies the maximum."""
        store, r = peers.store, peers.round
        mine = self._learning.current
        if auto.merge(self._job_known, mine) != self._job_known:
            store.set(jobsync.learned_key(r, peers.node_rank), jobsync.encode_learned(mine))
            store.add(jobsync.learned_version_key(r), 1)
            self._job_known = auto.merge(self._job_known, mine)
        version = store.add(jobsync.learned_version_key(r), 0)
        if version == self._seen_version:
            return
        self._seen_version = version
        keys = [jobsync.learned_key(r, n) for n in range(peers.nnodes) if n != peers.node_rank]
        job = LearnedTimeouts()
        for key, raw in zip(keys, store.get_many(keys), strict=True):
            if raw is None:
                continue
            try:
                job = auto.merge(job, jobsync.decode_learned(raw))
            except ValueError as exc:
                self._warn(key, "ignoring learned timeouts at store key %s: %s", key, exc)
        self._job_known = auto.merge(self._job_known, job)
        self._learning.fold(job, "job")
