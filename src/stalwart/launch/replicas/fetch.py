"""Fetch on restore: a node that takes over ranks (a spare after a node loss) copies
their snapshots from its peers before its workers start."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from stalwart.base.events import Event
from stalwart.checkpoint import ramlayout as rl
from stalwart.launch.replicas import auth, wire
from stalwart.launch.replicas.ring import fetch_order
from stalwart.launch.replicas.segments import Emit, ReplicaHolder
from stalwart.launch.replicas.server import PeerAddress, connect, transfer_deadline

logger = logging.getLogger(__name__)

# A worker's own segment (``ramlayout.segment_name``), as opposed to a replica or pin.
LOCAL_PREFIX = rl.segment_name(0).removesuffix(f"0{rl.SEGMENT_SUFFIX}")

REPLICA_FETCHED = Event.REPLICA_FETCHED
REPLICA_FETCH_FAILED = Event.REPLICA_FETCH_FAILED


def offer(
    peer: PeerAddress, rank: int, world_size: int, key: bytes, me: int
) -> wire.Manifest | None:
    with connect(peer, key, me) as sock:
        wire.send_frame(sock, wire.Fetch(rank, world_size, send=False))
        got = wire.recv_frame(sock)
        return _checked(got, rank, world_size, key) if isinstance(got, wire.Offer) else None


def fetch(
    peer: PeerAddress, holder: ReplicaHolder, rank: int, world_size: int, key: bytes, me: int
) -> wire.Manifest:
    """Copy a peer's newest snapshot of ``rank`` into this node's replica of it."""
    with connect(peer, key, me) as sock:
        wire.send_frame(sock, wire.Fetch(rank, world_size, send=True))
        got = wire.recv_frame(sock)
        man = _checked(got, rank, world_size, key) if isinstance(got, wire.Offer) else None
        if man is None:
            raise wire.WireError(f"the peer holds no snapshot of rank {rank} any more")
        rec = man.record
        until = transfer_deadline(rec.skeleton_bytes + rec.tensor_bytes)
        reply = holder.receive(sock, man, announce=False, deadline=until)
        if not reply.ok:
            raise wire.WireError(reply.error)
        return man


def _checked(got: wire.Offer, rank: int, world_size: int, key: bytes) -> wire.Manifest | None:
    """The offered manifest, if it is of the rank asked for and MACed by the job's key."""
    man = got.manifest
    if man is None:
        return None
    rec = man.record
    if (rec.rank, rec.world_size) != (rank, world_size):
        raise wire.WireError(f"offered rank {rec.rank} of {rec.world_size} for {rank}")
    if not auth.record_ok(key, rec, man.mac):
        raise auth.AuthError(f"rank {rank} step {rec.step}: the record's MAC differs")
    return man


@dataclass(frozen=True)
class Fetched:
    rank: int
    step: int | None
    from_node: int | None
    nbytes: int
    seconds: float
    error: str = ""


def fetch_missing(
    holder: ReplicaHolder,
    ranks: list[int],
    world_size: int,
    peers: dict[int, PeerAddress],
    emit: Emit,
    key: bytes,
    me: int,
) -> list[Fetched]:
    """For each of ``ranks``, copy the newest snapshot a peer has, unless this folder
    holds that step already (or the rank ran here: its own segment is the newest)."""
    out: list[Fetched] = []
    for rank in ranks:
        have = holder.newest(rank, world_size)
        have_step: int | None = None
        if have is not None:
            have[0].close()
            if have[0].path.name.startswith(LOCAL_PREFIX):
                continue  # the rank ran here: peers hold copies of this segment, not newer
            have_step = have[2].step
        t0 = time.monotonic()
        offers: list[tuple[int, int, int]] = []  # (step, seq, node)
        errors: list[str] = []
        for node, peer in sorted(peers.items()):
            try:
                man = offer(peer, rank, world_size, key, me)
            except (OSError, wire.WireError) as exc:
                errors.append(f"node {node}: {exc}")
                continue
            if man is not None:
                offers.append((man.record.step, man.record.seq, node))
        order = fetch_order(have_step, offers)
        if have_step is not None and not order:
            continue  # what this node holds is as new as any peer's
        got: Fetched | None = None
        for node in order:
            try:
                man = fetch(peers[node], holder, rank, world_size, key, me)
            except (OSError, wire.WireError) as exc:
                errors.append(f"node {node}: {exc}")
                continue
            rec = man.record
            got = Fetched(
                rank,
                rec.step,
                node,
                rec.skeleton_bytes + rec.tensor_bytes,
                time.monotonic() - t0,
            )
            emit(
                REPLICA_FETCHED,
                rank=rank,
                step=rec.step,
                from_node=node,
                bytes=got.nbytes,
                seconds=round(got.seconds, 4),
            )
            break
        if got is None and have_step is not None:
            logger.warning(
                "rank %d restores from its older replica at step %d: %s",
                rank,
                have_step,
                "; ".join(errors),
            )
            continue
        if got is None:
            why = "; ".join(errors) or "no peer holds a snapshot of it"
            got = Fetched(rank, None, None, 0, time.monotonic() - t0, why)
            logger.warning("no replica of rank %d to restore from RAM: %s", rank, why)
            emit(REPLICA_FETCH_FAILED, rank=rank, world_size=world_size, error=why)
        out.append(got)
    return out
