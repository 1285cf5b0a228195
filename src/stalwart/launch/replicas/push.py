"""The sending side: a low-priority thread that pushes this node's newest committed
snapshots to its ring peers."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stalwart.base.events import Event
from stalwart.checkpoint import ramlayout as rl
from stalwart.launch.replicas import auth, wire
from stalwart.launch.replicas.ring import ring_targets
from stalwart.launch.replicas.segments import Emit, SegmentFile, send_slot
from stalwart.launch.replicas.server import (
    KVLike,
    OneLine,
    PeerAddress,
    connect,
    lookup,
    lower_priority,
)

logger = logging.getLogger(__name__)

REPLICA_PEER_LOST = Event.REPLICA_PEER_LOST
REPLICA_REFUSED = Event.REPLICA_REFUSED
_CLOSE_WAIT_S = 2.0


class PeerGone(Exception):
    """A peer that cannot be reached or broke the stream."""


class SourceChanged(Exception):
    """The worker overwrote the slot while it was sent (a newer snapshot is there)."""


def push(
    peer: PeerAddress,
    seg: SegmentFile,
    slot: int,
    rec: rl.CommitRecord,
    ring: Ring,
    key: bytes,
) -> str:
    """Push one snapshot of this node's to a peer; '' when it committed it, else why it
    refused.

    Raises ``PeerGone`` when the peer cannot be reached, does not prove it is of the job,
    or the stream breaks, and ``SourceChanged`` when the slot was overwritten while it
    was read."""
    try:
        with connect(peer, key, ring.me) as sock:
            manifest = wire.Manifest(rec, ring.me, auth.record_mac(key, rec))
            wire.send_frame(sock, wire.Push(ring.round, manifest))
            ready = wire.expect(sock, wire.Reply)
            assert isinstance(ready, wire.Reply)
            if not ready.ok:
                return ready.error
            ok = send_slot(sock, seg, slot, rec)
            wire.send_frame(sock, wire.End(ok))
            done = wire.expect(sock, wire.Reply)
            assert isinstance(done, wire.Reply)
    except (OSError, wire.WireError) as exc:
        raise PeerGone(f"{peer.addr}:{peer.port}: {exc}") from None
    if not ok:
        raise SourceChanged(f"rank {rec.rank} step {rec.step}")
    return "" if done.ok else done.error


@dataclass(frozen=True)
class Ring:
    round: int
    me: int
    nodes: int
    k: int


class Replicator:
    """A low-priority thread that pushes this node's newest snapshots to its ring peers."""

    def __init__(
        self,
        folder: Path,
        nproc: int,
        kv: KVLike,
        emit: Emit,
        key: bytes,
        *,
        poll_s: float = 0.05,
        after_pass: Callable[[], None] | None = None,
    ) -> None:
        """``key``: the job's (``auth.job_key``); ``after_pass``: called on this
        thread after each look at the segments."""
        self._folder = folder
        self._key = key
        self._trouble = OneLine(None)
        self._after_pass = after_pass
        self._nproc = nproc
        self._kv = kv
        self._emit = emit
        self._poll_s = poll_s
        self._ring: Ring | None = None
        self._lost: set[int] = set()
        self._sent: dict[tuple[int, int], tuple[int, int, int, float]] = {}  # (node, lr)
        self._peers: dict[int, PeerAddress] = {}
        self._refused: set[tuple[int, int]] = set()  # (node, rank) told once until it takes one
        #: Push outcomes so far: committed, refused, changed (source overwritten meanwhile).
        self.outcomes: collections.Counter[str] = collections.Counter()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="stalwart-replicator", daemon=True)
        self._thread.start()

    def set_ring(self, ring: Ring | None) -> None:
        """A new round: new peers, and a lost node of the last round may be back."""
        with self._cond:
            self._ring = ring
            self._lost = set()
            self._sent = {}
            self._peers = {}
            self._refused = set()
            self._cond.notify_all()

    def targets(self) -> list[int]:
        with self._cond:
            ring = self._ring
            lost = frozenset(self._lost)
        return [] if ring is None else ring_targets(ring.me, ring.nodes, ring.k, lost)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        # A push to a peer that stopped reading ends at its socket timeout; the launcher
        # does not wait for that (the thread is a daemon and holds no file open for long).
        self._thread.join(timeout=_CLOSE_WAIT_S)
        if self._thread.is_alive():
            logger.warning("replication thread still in a push; leaving it behind")

    def _run(self) -> None:
        lower_priority()
        segs: dict[int, SegmentFile] = {}
        try:
            while True:
                with self._cond:
                    if self._stop:
                        return
                    ring = self._ring
                if ring is not None and ring.k > 0:
                    try:
                        self._pass(ring, segs)
                    except Exception:
                        logger.exception("replication pass failed; trying again")
                if self._after_pass is not None:
                    try:
                        self._after_pass()
                    except Exception:
                        logger.exception("after a replication pass")
                with self._cond:
                    if self._stop:
                        return
                    self._cond.wait(self._poll_s)
        finally:
            for seg in segs.values():
                seg.close()

    def _pass(self, ring: Ring, segs: dict[int, SegmentFile]) -> None:
        for lr in range(self._nproc):
            if lr in segs and not segs[lr].unchanged():
                segs.pop(lr).close()  # replaced or damaged: map it again, if it is whole
            if lr not in segs:
                try:
                    segs[lr] = SegmentFile(self._folder / rl.segment_name(lr), writable=False)
                except (OSError, ValueError):
                    continue
            held = segs[lr].records()
            if not held:
                continue
            slot, rec = held[0]
            key = (rec.step, rec.seq, rec.rank, rec.created_unix)
            for node in self.targets():
                if self._ring is not ring:
                    return
                if self._sent.get((node, lr)) == key:
                    continue
                peer = self._peer(ring, node)
                if peer is None:
                    continue  # not published yet: the next pass looks again
                try:
                    why = push(peer, segs[lr], slot, rec, ring, self._key)
                except PeerGone as exc:
                    self._peer_lost(ring, node, str(exc))
                    return  # the next pass sends to the node that replaces it
                except SourceChanged:
                    self.outcomes["changed"] += 1
                    break  # the next pass sends the newer snapshot
                self._sent[(node, lr)] = key
                self.outcomes["refused" if why else "committed"] += 1
                if not why:
                    self._refused.discard((node, rec.rank))
                elif (node, rec.rank) not in self._refused:
                    # Once per peer and rank until it takes one again, not per snapshot.
                    self._refused.add((node, rec.rank))
                    logger.warning("node %d refused a replica: %s", node, why)
                    self._emit(
                        REPLICA_REFUSED, to_node=node, rank=rec.rank, step=rec.step, error=why
                    )

    def _peer(self, ring: Ring, node: int) -> PeerAddress | None:
        if node not in self._peers:
            try:
                self._peers.update(lookup(self._kv, ring.round, [node], self._key, self._trouble))
            except Exception as exc:  # the store's own errors reach the supervisor
                logger.debug("cannot look up node %d's replica server: %s", node, exc)
        return self._peers.get(node)

    def _peer_lost(self, ring: Ring, node: int, error: str) -> None:
        with self._cond:
            if self._ring is not ring:
                return
            self._lost.add(node)
            lost = frozenset(self._lost)
        nxt = ring_targets(ring.me, ring.nodes, ring.k, lost)
        logger.warning(
            "replica peer node %d lost (%s); replicating to %s", node, error, nxt or "no node"
        )
        self._emit(REPLICA_PEER_LOST, attempt=ring.round, lost_node=node, error=error, targets=nxt)
