"""Snapshot replicas on peer nodes (``stalwart run --ckpt-ram SIZE --ckpt-replicas K``).

Each launcher serves its snapshot folder (``snapshots.py``) on a TCP port published in
the job's store, and a low-priority thread copies the newest committed snapshot of each
of its local ranks to the next K nodes of the round in ring order (by node rank). The
receiver keeps one replica segment per rank in the same folder, in the same layout as
the local ones (``ramlayout``: two slots, commit record last), so a worker that looks
for its snapshots (``checkpoint.ram.find_snapshots``) finds replicas too, and the resume
agreement (``checkpoint.resume``) counts their steps. A replica is committed only after
all its bytes arrived and their checksums match the manifest's: a torn one is never used.

A node pins its own ranks' snapshot at the step of each replica it commits
(``pins``), so a lagging replica still shares a step with the survivors.

When a node takes over ranks it holds no snapshot of (a spare after a node loss), its
launcher asks the others for them while its workers start (``fetch_missing``; a
worker's restore waits for the copy). The parts: ``ring`` (decisions),
``segments``, ``server``, ``push``, ``fetch``,
``pins``; the stream's steps are in ``wire``; what goes on is in
``events.jsonl`` (``REPLICA_*`` below). This module is the supervisor's handle and
names the parts' public names in one place.
"""

import logging
import threading
import time
from pathlib import Path

from stalwart.checkpoint import ramlayout as rl
from stalwart.launch.replicas.auth import AuthError, job_key
from stalwart.launch.replicas.fetch import (
    LOCAL_PREFIX,
    REPLICA_FETCH_FAILED,
    REPLICA_FETCHED,
    Fetched,
    fetch,
    fetch_missing,
    offer,
)
from stalwart.launch.replicas.pins import Pins
from stalwart.launch.replicas.push import (
    REPLICA_PEER_LOST,
    REPLICA_REFUSED,
    PeerGone,
    Replicator,
    Ring,
    SourceChanged,
    push,
)
from stalwart.launch.replicas.ring import effective_replicas, ring_targets
from stalwart.launch.replicas.segments import (
    FREE_PREFIX,
    REPLICA_NO_ROOM,
    REPLICA_PREFIX,
    Emit,
    NoRoom,
    ReplicaHolder,
    SegmentFile,
    newest_replica,
    replica_ranks,
    send_slot,
)
from stalwart.launch.replicas.server import (
    MAX_CONNECTIONS,
    MAX_PER_HOST,
    REPLICA_CONN_REFUSED,
    STORE_KEY,
    KVLike,
    PeerAddress,
    ReplicaServer,
    connect,
    lookup,
    publish,
)

__all__ = [
    "FREE_PREFIX",
    "MAX_CONNECTIONS",
    "MAX_PER_HOST",
    "REPLICA_CONN_REFUSED",
    "REPLICA_FETCHED",
    "REPLICA_FETCH_FAILED",
    "REPLICA_NO_ROOM",
    "REPLICA_PEER_LOST",
    "REPLICA_PREFIX",
    "REPLICA_REFUSED",
    "STORE_KEY",
    "AuthError",
    "Fetched",
    "KVLike",
    "NoRoom",
    "NodeReplicas",
    "PeerAddress",
    "PeerGone",
    "ReplicaHolder",
    "ReplicaServer",
    "Replicator",
    "Ring",
    "SegmentFile",
    "SourceChanged",
    "advertised_address",
    "connect",
    "effective_replicas",
    "fetch",
    "fetch_missing",
    "job_key",
    "lookup",
    "newest_replica",
    "offer",
    "publish",
    "push",
    "replica_ranks",
    "ring_targets",
    "send_slot",
]

logger = logging.getLogger(__name__)

# -- the supervisor's handle -----------------------------------------------------------
_PEERS_WAIT_S = 5.0
# A fetch ends at its sockets' timeouts; closing does not wait that long for it.
_CLOSE_FETCH_WAIT_S = 2.0


def advertised_address(rdzv: object) -> tuple[KVLike, str] | None:
    """The job's store and the address peers reach this node at, for rendezvous kinds
    that have both (every multi-node one)."""
    from stalwart.rendezvous.elastic import ElasticRendezvous
    from stalwart.rendezvous.kv import local_address_towards
    from stalwart.rendezvous.static import StaticRendezvous

    if isinstance(rdzv, ElasticRendezvous):
        return rdzv.kv, rdzv.local_addr
    if isinstance(rdzv, StaticRendezvous):
        return rdzv.kv, local_address_towards(rdzv.endpoint.host, rdzv.endpoint.port)
    return None


class NodeReplicas:
    """One launcher's part in replication: its server, its sender, and the fetch of the
    ranks it takes over at the start of a round."""

    def __init__(
        self,
        folder: Path,
        slot_bytes: int,
        nproc: int,
        k: int,
        kv: KVLike,
        addr: str,
        emit: Emit,
        *,
        max_nodes: int,
        key: bytes,
    ) -> None:
        """``key``: the job's (``auth.job_key``): only nodes that hold it are
        served, pushed to or fetched from."""
        self.k = k
        self._key = key
        self._round = -1
        self._kv = kv
        self._nproc = nproc
        self._emit = emit
        self._node = -1
        self._fetching: threading.Thread | None = None
        self.fetched: list[Fetched] = []
        # In a steady ring this node holds the replicas of K nodes' ranks (as many as it
        # runs, with the same --nproc-per-node everywhere).
        reserve = min(k, max(0, max_nodes - 1)) * nproc
        self.pins: Pins | None = None
        if reserve:
            try:
                self.pins = Pins(folder, slot_bytes, nproc)
            except NoRoom as exc:
                error = f"no room to pin this node's snapshots at its replicas' step ({exc})"
                logger.warning("%s", error)
                emit(REPLICA_NO_ROOM, rank=None, error=error)
        pins = self.pins
        self.holder = ReplicaHolder(
            folder,
            slot_bytes,
            emit,
            reserve=reserve,
            on_commit=None if pins is None else lambda rec: pins.follow(rec.step, rec.world_size),
        )
        self.server = ReplicaServer(self.holder, addr, lambda: self._node, key, self._peer_of, emit)
        try:
            self.replicator = Replicator(
                folder,
                nproc,
                kv,
                emit,
                key,
                after_pass=None if pins is None else pins.drop_stale,
            )
        except BaseException:
            self.server.close()
            self.holder.close()
            if pins is not None:
                pins.close()
            raise

    def begin_round(
        self, round_: int, node: int, nodes: int, base_rank: int, world_size: int
    ) -> None:
        """Publish this node's server, point the sender at the new ring, and bring in
        the snapshots of ranks this node now runs and holds none of (after a node loss).

        The copy runs on a thread while the launcher starts its workers (their start-up,
        seconds, overlaps it); the folder holds ``FETCHING_MARKER`` until it is done, and
        a worker's restore waits for that."""
        self.wait_fetched()
        self._node = node
        self._round = round_
        self.replicator.set_ring(None)
        publish(
            self._kv,
            round_,
            self.server.address(round_, node, base_rank, self._nproc, world_size),
        )
        self.replicator.set_ring(Ring(round_, node, nodes, min(self.k, nodes - 1)))
        if round_ == 0 or nodes < 2:
            return  # a new job: nobody holds anything yet
        ranks = [base_rank + lr for lr in range(self._nproc)]
        if not any(not self._ran_here(rank, world_size) for rank in ranks):
            return  # a survivor: its own segments are the newest of its ranks
        marker = self.holder.folder / rl.FETCHING_MARKER
        marker.touch()
        self.fetched = []
        self._fetching = threading.Thread(
            target=self._fetch,
            args=(round_, node, nodes, ranks, world_size, marker),
            name="stalwart-replica-fetch",
            daemon=True,
        )
        self._fetching.start()

    def _ran_here(self, rank: int, world_size: int) -> bool:
        have = self.holder.newest(rank, world_size)
        if have is None:
            return False
        have[0].close()
        return have[0].path.name.startswith(LOCAL_PREFIX)

    def _fetch(
        self, round_: int, node: int, nodes: int, ranks: list[int], world_size: int, marker: Path
    ) -> None:
        try:
            others = [n for n in range(nodes) if n != node]
            deadline = time.monotonic() + _PEERS_WAIT_S
            peers = self._lookup(round_, others)
            # Every node publishes right after it joins; a few ms apart.
            while len(peers) < len(others) and time.monotonic() < deadline:
                time.sleep(0.02)
                peers = self._lookup(round_, others)
            self.fetched = fetch_missing(
                self.holder, ranks, world_size, peers, self._emit, self._key, node
            )
        except Exception:
            logger.exception("fetching snapshots from peers failed; workers restore without")
        finally:
            marker.unlink(missing_ok=True)

    def _lookup(self, round_: int, nodes: list[int]) -> dict[int, PeerAddress]:
        return lookup(self._kv, round_, nodes, self._key, self.server.trouble)

    def _peer_of(self, round_: int, node: int) -> PeerAddress | None:
        """A node's verified address in a round (for the server's ownership check)."""
        if round_ > self._round + 1:
            return None  # a round that cannot have begun
        try:
            return self._lookup(round_, [node]).get(node)
        except Exception as exc:  # the store's own errors reach the supervisor
            logger.debug("cannot look up node %d's replica address: %s", node, exc)
            return None

    def wait_fetched(self, timeout: float | None = None) -> list[Fetched]:
        """What the last round's fetch brought in, once it is done."""
        if self._fetching is not None:
            self._fetching.join(timeout)
        return self.fetched

    def close(self) -> None:
        self.wait_fetched(_CLOSE_FETCH_WAIT_S)
        self.replicator.close()
        self.server.close()
        self.holder.close()
        if self.pins is not None:
            self.pins.close()
