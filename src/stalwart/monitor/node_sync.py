"""The sync thread: a node monitor's share of the job's store.

Through `JobPeers.store` (see `monitor.jobsync` for the keys and encodings) it publishes
this node's learned timeouts and straggler windows, reads the other nodes', folds their
learned timeouts into this node's and compares the job's windows. A lost store is
logged once per key and left to the supervisor.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from stalwart.monitor import auto, jobsync
from stalwart.monitor.jobsync import JobPeers, NodeRhythm
from stalwart.monitor.judge import stragglers
from stalwart.monitor.learned import LearnedTimeouts
from stalwart.monitor.node_learned import NodeLearning
from stalwart.monitor.node_state import _Window
from stalwart.monitor.node_stragglers import NodeStragglers

log = logging.getLogger(__name__)


class NodeSync(NodeLearning, NodeStragglers):
    """The job-sync thread of a node monitor."""

    def _sync_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                peers = self._peers
            if peers is not None:
                try:
                    self._sync_once(peers)
                except Exception as exc:  # a lost store is the supervisor's to act on
                    self._sync_warn("store", "could not share monitor state with the job: %s", exc)
            self._sync_wake.wait(jobsync.SYNC_EVERY)
            self._sync_wake.clear()

    def _sync_warn(self, key: str, fmt: str, *args: Any) -> None:
        if key not in self._sync_warned:
            self._sync_warned.add(key)
            log.warning(fmt, *args)

    def _sync_once(self, peers: JobPeers) -> None:
        if peers.round != self._sync_round:  # a new round's keys: publish again, read again
            self._sync_round, self._job_known, self._seen_version = (
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

    def _sync_window(self, peers: JobPeers, window: _Window) -> None:
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
                self._sync_warn(key, "ignoring a straggler window at store key %s: %s", key, exc)
        steps, hosts = jobsync.pool_rhythms(window.rhythm, peers.node_rank, others)
        verdicts = stragglers(steps, self.config.straggler_factor)
        self._report_stragglers(verdicts, steps, hosts, window, peers, 1 + len(others))

    def _sync_learned(self, peers: JobPeers) -> None:
        """Publishes this node's learned timeouts when they changed; reads the others'
        when any changed (one counter read per poll otherwise) and applies the maximum."""
        store, r = peers.store, peers.round
        with self._lock:
            mine = self._learned
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
                self._sync_warn(key, "ignoring learned timeouts at store key %s: %s", key, exc)
        self._job_known = auto.merge(self._job_known, job)
        self._fold_learned(job, "job")
