"""Snapshot replicas on peer nodes (``stalwart run --ckpt-ram SIZE --ckpt-replicas K``).

Each launcher serves its snapshot folder (``snapshots.py``) on a TCP port published in
the job's store, and a low-priority thread copies the newest committed snapshot of each
of its local ranks to the next K nodes of the round in ring order (by node rank). The
receiver keeps one replica segment per rank in the same folder, in the same layout as
the local ones (``ramlayout``: two slots, commit record last), so a worker that looks
for its snapshots (``checkpoint.ram.find_snapshots``) finds replicas too, and the resume
agreement (``checkpoint.resume``) counts their steps. A replica is committed only after
all its bytes arrived and their checksums match the manifest's: a torn one is never used.

When a node takes over ranks it holds no snapshot of (a spare after a node loss), its
launcher asks the others for them before starting its workers (``fetch_missing``).
The stream's steps are in ``replicawire``; what goes on is in ``events.jsonl``
(``REPLICA_*`` below).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import secrets
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import psutil
import xxhash

from stalwart.base.events import Event
from stalwart.checkpoint import ramlayout as rl
from stalwart.launch import replicawire as wire
from stalwart.launch.snapshots import reserve
from stalwart.rendezvous.kv import listen_socket

logger = logging.getLogger(__name__)

#: Store key of a node's replica server in a round: JSON ``PeerAddress``.
STORE_KEY = "replicas/r{round}/{node}"
# The event kinds, spelled in base.events (short names for this module and its tests).
REPLICA_PEER_LOST = Event.REPLICA_PEER_LOST
REPLICA_NO_ROOM = Event.REPLICA_NO_ROOM
REPLICA_REFUSED = Event.REPLICA_REFUSED
REPLICA_FETCHED = Event.REPLICA_FETCHED
REPLICA_FETCH_FAILED = Event.REPLICA_FETCH_FAILED
REPLICA_PREFIX = "replica_r"
# Reserved segments not yet holding a rank: no SEGMENT_SUFFIX, so workers never map them.
FREE_PREFIX = "free_replica_"
# Linux >= 5.14: fault pages in writable without writing them.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# Replication yields to training on a contended core (the writer child runs at +5).
# Not +19: that weighs 15 against a busy nice-0 process's 1024 (CFS), so on a loaded
# host a replica could lag past the next snapshot, and one that lags by more than a
# generation shares no step with the survivors' own snapshots.
_NICE = 10
_CONNECT_TIMEOUT_S = 3.0
_IO_TIMEOUT_S = 30.0
_CLOSE_WAIT_S = 2.0

Emit = Callable[..., Any]


class KVLike(Protocol):
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...

    def set(self, key: str, value: str, *, leased: bool = False) -> None: ...


class PeerAddress(msgspec.Struct, frozen=True):
    addr: str
    port: int
    token: str  # only requests that carry it are served


def ring_targets(me: int, nodes: int, k: int, lost: frozenset[int] = frozenset()) -> list[int]:
    """The nodes that hold this node's replicas: the next ``k`` in ring order, skipping
    the ``lost`` ones (replication moves on to the node after a lost one)."""
    order = [(me + i) % nodes for i in range(1, nodes)]
    return [n for n in order if n not in lost][: max(0, k)]


def effective_replicas(flag: int | None, max_nodes: int) -> int:
    """``--ckpt-replicas``: unset means 1 when the job may have 2 or more nodes."""
    if flag is None:
        return 1 if max_nodes >= 2 else 0
    return flag


def _lower_priority() -> None:
    # Linux nice values are per thread: this lowers only the calling thread.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)


# -- segments, as the launcher sees them (no torch) -------------------------------------
class SegmentFile:
    """A snapshot segment mapped by the launcher: a worker's, or a replica."""

    def __init__(self, path: Path, *, writable: bool) -> None:
        self.path = path
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags)
        try:
            size = os.fstat(fd).st_size
            self.slot_bytes = rl.slot_capacity(size)
            if self.slot_bytes < rl.PAGE:
                raise ValueError(f"{path}: {size} bytes is too small for a snapshot segment")
            length = rl.GENERATIONS * rl.slot_stride(self.slot_bytes)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._map = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)

    def record(self, slot: int) -> rl.CommitRecord | None:
        at = rl.header_offset(slot, self.slot_bytes)
        return rl.decode_header(self._map[at : at + rl.SLOT_HEADER])

    def records(self) -> list[tuple[int, rl.CommitRecord]]:
        """Committed slots, newest (highest seq) first."""
        found = [(s, r) for s in range(rl.GENERATIONS) if (r := self.record(s)) is not None]
        return sorted(found, key=lambda sr: sr[1].seq, reverse=True)

    def newest_of(self, rank: int, world_size: int) -> tuple[int, rl.CommitRecord] | None:
        mine = [(s, r) for s, r in self.records() if r.rank == rank and r.world_size == world_size]
        return max(mine, key=lambda sr: (sr[1].step, sr[1].seq), default=None)

    def region(self, slot: int, offset: int, length: int) -> memoryview:
        start = rl.data_offset(slot, self.slot_bytes) + offset
        return memoryview(self._map)[start : start + length]

    def populate(self) -> None:
        """Fill this mapping's page tables now rather than one fault per page later."""
        try:
            self._map.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError) as exc:
            logger.debug("could not pre-fault %s: %s", self.path, exc)

    def invalidate(self, slot: int) -> None:
        at = rl.header_offset(slot, self.slot_bytes)
        self._map[at : at + rl.PREFIX_BYTES] = rl.EMPTY_PREFIX

    def commit(self, slot: int, record: rl.CommitRecord) -> None:
        prefix, body = rl.split_header(record)
        at = rl.header_offset(slot, self.slot_bytes)
        self._map[at + rl.PREFIX_BYTES : at + rl.PREFIX_BYTES + len(body)] = body
        self._map[at : at + rl.PREFIX_BYTES] = prefix  # the commit, last

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self._map.close()


def send_slot(sock: socket.socket, seg: SegmentFile, slot: int, rec: rl.CommitRecord) -> bool:
    """Send a slot's bytes; True when its commit record was unchanged after the read."""
    with seg.region(slot, 0, rec.skeleton_bytes) as view:
        sock.sendall(view)
    with seg.region(slot, rec.tensor_offset, rec.tensor_bytes) as view:
        sock.sendall(view)
    # A worker invalidates the header before it overwrites a slot: unchanged header,
    # unchanged bytes (the receiver's checksums catch the rest).
    return seg.record(slot) == rec


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class NoRoom(Exception):
    """No memory for a replica segment; the message is one line."""


class ReplicaHolder:
    """This node's replicas of other nodes' ranks, in its snapshot folder."""

    def __init__(self, folder: Path, slot_bytes: int, emit: Emit, *, reserve: int = 0) -> None:
        """``reserve``: segments to allocate now, so that taking a rank's first replica
        (a spare's fetch after a node loss included) does not wait for the allocation,
        and a host without the memory says so at start-up."""
        self.folder = folder
        self.slot_bytes = slot_bytes
        self.segment_bytes = rl.segment_bytes(slot_bytes)
        self._emit = emit
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()
        self._no_room_told: set[int] = set()
        self._open: dict[int, SegmentFile] = {}
        self._free: list[SegmentFile] = []
        for i in range(reserve):
            path = folder / f"{FREE_PREFIX}{i}"
            try:
                self._allocate(path)
            except NoRoom as exc:
                error = (
                    f"no room to reserve {reserve} replica segment(s) of "
                    f"{_mib(self.segment_bytes)} ({exc}); replicas of peers' snapshots may "
                    "be refused"
                )
                logger.warning("%s", error)
                self._emit(REPLICA_NO_ROOM, rank=None, error=error)
                break
            self._free.append(SegmentFile(path, writable=True))
        self._populating: threading.Thread | None = None
        if self._free:
            # Filling the page tables of a fresh mapping costs about as much as receiving
            # into it (0.3 s of 0.5 s for 64 MiB, measured): done now, off the path of a
            # restart's fetch. madvise releases the GIL.
            self._populating = threading.Thread(
                target=self._populate,
                args=(tuple(self._free),),
                name="stalwart-replica-populate",
                daemon=True,
            )
            self._populating.start()

    @staticmethod
    def _populate(segs: tuple[SegmentFile, ...]) -> None:
        for seg in segs:
            seg.populate()

    def lock(self, rank: int) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(rank, threading.Lock())

    def path_of(self, rank: int) -> Path:
        return self.folder / f"{REPLICA_PREFIX}{rank}{rl.SEGMENT_SUFFIX}"

    def _segment(self, rank: int) -> SegmentFile:
        """The rank's replica segment, mapped once and kept (under the rank's lock)."""
        seg = self._open.get(rank)
        if seg is None:
            path = self.path_of(rank)
            with self._guard:
                free = self._free.pop() if self._free and not path.exists() else None
            if free is not None:
                os.rename(free.path, path)  # the mapping stays valid
                free.path = path
                seg = free
            else:
                if not path.exists():
                    self._allocate(path)
                seg = SegmentFile(path, writable=True)
            self._open[rank] = seg
        return seg

    def close(self) -> None:
        busy = self._populating is not None and self._populating.is_alive()
        with self._guard:
            # Still being populated: those mappings go with the process, not under it.
            segs = [*self._open.values(), *([] if busy else self._free)]
            self._open.clear()
            self._free.clear()
        for seg in segs:
            seg.close()

    def _allocate(self, path: Path) -> None:
        try:
            st = os.statvfs(self.folder)
            free = st.f_bavail * st.f_frsize
        except OSError as exc:
            raise NoRoom(f"cannot use {self.folder}: {exc.strerror}") from None
        memory = psutil.virtual_memory().available
        if self.segment_bytes > min(free, memory):
            where = f"{self.folder} has {_mib(free)}" if free < memory else f"{_mib(memory)} is"
            raise NoRoom(f"needs {_mib(self.segment_bytes)} but {where} free")
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            no_room = reserve(fd, self.segment_bytes)
            if no_room is not None:
                raise NoRoom(
                    f"cannot reserve {_mib(self.segment_bytes)} in {self.folder} ({no_room})"
                )
            # Named only once whole: a worker never maps a half-reserved segment.
            os.rename(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)

    def receive(
        self, sock: socket.socket, manifest: wire.Manifest, *, announce: bool
    ) -> wire.Reply:
        """Take a snapshot off the stream into the slot that is not the newest.

        ``announce``: a push, whose sender waits for a go-ahead (or a refusal) before it
        sends the bytes and for the verdict after; a fetch has neither."""
        rec = manifest.record

        def answer(reply: wire.Reply) -> wire.Reply:
            if announce:
                wire.send_frame(sock, reply)
            return reply

        try:
            skel, tensors = wire.payload_sizes(rec, self.slot_bytes)
        except wire.WireError as exc:
            return answer(wire.Reply(False, str(exc)))
        with self.lock(rec.rank):
            try:
                seg = self._segment(rec.rank)
            except NoRoom as exc:
                error = f"no room for a replica of rank {rec.rank}: {exc}"
                if rec.rank not in self._no_room_told:  # once per rank, not per snapshot
                    self._no_room_told.add(rec.rank)
                    logger.warning("%s", error)
                    self._emit(REPLICA_NO_ROOM, rank=rec.rank, error=error)
                return answer(wire.Reply(False, error))
            answer(wire.Reply(True))  # go ahead
            return answer(self._fill(sock, seg, rec, skel, tensors))

    def _fill(
        self, sock: socket.socket, seg: SegmentFile, rec: rl.CommitRecord, skel: int, tensors: int
    ) -> wire.Reply:
        held = seg.records()
        slot = 0 if not held else 1 - held[0][0]
        seg.invalidate(slot)
        with seg.region(slot, 0, skel) as view:
            wire.recv_exact(sock, view)
            skeleton_hash = xxhash.xxh3_64_intdigest(view)
        with seg.region(slot, rec.tensor_offset, tensors) as view:
            wire.recv_exact(sock, view)
            tensor_hash = xxhash.xxh3_64_intdigest(view)
        end = wire.expect(sock, wire.End)
        assert isinstance(end, wire.End)
        if not end.ok:
            return wire.Reply(False, "the source snapshot changed while it was sent")
        if (skeleton_hash, tensor_hash) != (rec.skeleton_hash, rec.tensor_hash):
            return wire.Reply(False, f"rank {rec.rank} step {rec.step}: checksum differs")
        seq = held[0][1].seq + 1 if held else 1
        seg.commit(slot, msgspec.structs.replace(rec, seq=seq))
        for other, old in held:
            if other != slot and old.step > rec.step:
                # The job went back to an older step: the newer replica is not its future.
                seg.invalidate(other)
        self._no_room_told.discard(rec.rank)
        return wire.Reply(True)

    def newest(self, rank: int, world_size: int) -> tuple[SegmentFile, int, rl.CommitRecord] | None:
        """The newest committed snapshot of a rank in this folder, local or replica."""
        best: tuple[SegmentFile, int, rl.CommitRecord] | None = None
        for path in sorted(self.folder.glob(f"*{rl.SEGMENT_SUFFIX}")):
            try:
                seg = SegmentFile(path, writable=False)
            except (OSError, ValueError):
                continue
            got = seg.newest_of(rank, world_size)
            if got is not None and (
                best is None or (got[1].step, got[1].seq) > (best[2].step, best[2].seq)
            ):
                if best is not None:
                    best[0].close()
                best = (seg, got[0], got[1])
            else:
                seg.close()
        return best


# -- the receiving side: a server per launcher ----------------------------------------
class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(_IO_TIMEOUT_S)
        try:
            self.server.owner.serve(sock)
        except (OSError, wire.WireError) as exc:
            logger.debug("replica connection from %s ended: %s", self.client_address, exc)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    owner: ReplicaServer


class ReplicaServer:
    """Accepts pushes of peers' snapshots and serves this node's to a node that asks."""

    def __init__(self, holder: ReplicaHolder, addr: str, node_rank: Callable[[], int]) -> None:
        self.holder = holder
        self.token = secrets.token_hex(16)
        self._node_rank = node_rank
        sock = listen_socket(addr, 0)
        self.port = int(sock.getsockname()[1])
        self.addr = addr
        self._server = _Server((addr, self.port), _Handler, bind_and_activate=False)
        self._server.socket.close()
        self._server.socket = sock
        self._server.owner = self
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="stalwart-replica-server",
            daemon=True,
        )
        self._thread.start()

    @property
    def address(self) -> PeerAddress:
        return PeerAddress(self.addr, self.port, self.token)

    def serve(self, sock: socket.socket) -> None:
        first = wire.recv_frame(sock)
        if not isinstance(first, wire.Push | wire.Fetch):
            raise wire.WireError(f"unexpected {type(first).__name__} frame")
        if not secrets.compare_digest(first.token, self.token):
            wire.send_frame(sock, wire.Reply(False, "wrong token"))
            return
        if isinstance(first, wire.Push):
            # A push is background work; a fetch is not: a node's restart waits for it.
            _lower_priority()
            self.holder.receive(sock, first.manifest, announce=True)
            return
        with self.holder.lock(first.rank):
            found = self.holder.newest(first.rank, first.world_size)
            if found is None:
                wire.send_frame(sock, wire.Offer(None))
                return
            seg, slot, rec = found
            try:
                wire.send_frame(sock, wire.Offer(wire.Manifest(rec, self._node_rank())))
                if first.send:
                    wire.send_frame(sock, wire.End(send_slot(sock, seg, slot, rec)))
            finally:
                seg.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def publish(kv: KVLike, round_: int, node_rank: int, address: PeerAddress) -> None:
    kv.set(STORE_KEY.format(round=round_, node=node_rank), msgspec.json.encode(address).decode())


def lookup(kv: KVLike, round_: int, nodes: list[int]) -> dict[int, PeerAddress]:
    """The published replica servers of ``nodes`` (those not published yet are absent)."""
    keys = [STORE_KEY.format(round=round_, node=n) for n in nodes]
    found: dict[int, PeerAddress] = {}
    for node, raw in zip(nodes, kv.get_many(keys), strict=True):
        if raw is None:
            continue
        try:
            found[node] = msgspec.json.decode(raw, type=PeerAddress)
        except msgspec.DecodeError:
            logger.warning("ignoring a malformed replica address for node %d: %r", node, raw)
    return found


def _connect(peer: PeerAddress) -> socket.socket:
    sock = socket.create_connection((peer.addr, peer.port), timeout=_CONNECT_TIMEOUT_S)
    sock.settimeout(_IO_TIMEOUT_S)
    return sock


class PeerGone(Exception):
    """A peer that cannot be reached or broke the stream."""


class SourceChanged(Exception):
    """The worker overwrote the slot while it was sent (a newer snapshot is there)."""


def push(peer: PeerAddress, seg: SegmentFile, slot: int, rec: rl.CommitRecord, me: int) -> str:
    """Push one snapshot to a peer; '' when it committed it, else why it refused.

    Raises ``PeerGone`` when the peer cannot be reached or the stream breaks, and
    ``SourceChanged`` when the slot was overwritten while it was read."""
    try:
        with _connect(peer) as sock:
            wire.send_frame(sock, wire.Push(peer.token, wire.Manifest(rec, me)))
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


def offer(peer: PeerAddress, rank: int, world_size: int) -> wire.Manifest | None:
    with _connect(peer) as sock:
        wire.send_frame(sock, wire.Fetch(peer.token, rank, world_size, send=False))
        got = wire.recv_frame(sock)
        return got.manifest if isinstance(got, wire.Offer) else None


def fetch(peer: PeerAddress, holder: ReplicaHolder, rank: int, world_size: int) -> wire.Manifest:
    """Copy a peer's newest snapshot of ``rank`` into this node's replica of it."""
    with _connect(peer) as sock:
        wire.send_frame(sock, wire.Fetch(peer.token, rank, world_size, send=True))
        got = wire.recv_frame(sock)
        if not isinstance(got, wire.Offer) or got.manifest is None:
            raise wire.WireError(f"the peer holds no snapshot of rank {rank} any more")
        reply = holder.receive(sock, got.manifest, announce=False)
        if not reply.ok:
            raise wire.WireError(reply.error)
        return got.manifest


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
) -> list[Fetched]:
    """For each of ``ranks`` this folder holds no snapshot of, copy the newest a peer has."""
    out: list[Fetched] = []
    for rank in ranks:
        have = holder.newest(rank, world_size)
        if have is not None:
            have[0].close()
            continue
        t0 = time.monotonic()
        offers: list[tuple[int, int, int]] = []  # (step, seq, node)
        errors: list[str] = []
        for node, peer in sorted(peers.items()):
            try:
                man = offer(peer, rank, world_size)
            except (OSError, wire.WireError) as exc:
                errors.append(f"node {node}: {exc}")
                continue
            if man is not None:
                offers.append((man.record.step, man.record.seq, node))
        got: Fetched | None = None
        for _step, _seq, node in sorted(offers, reverse=True):
            try:
                man = fetch(peers[node], holder, rank, world_size)
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
        if got is None:
            why = "; ".join(errors) or "no peer holds a snapshot of it"
            got = Fetched(rank, None, None, 0, time.monotonic() - t0, why)
            logger.warning("no replica of rank %d to restore from RAM: %s", rank, why)
            emit(REPLICA_FETCH_FAILED, rank=rank, world_size=world_size, error=why)
        out.append(got)
    return out


# -- the sending side ------------------------------------------------------------------
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
        *,
        poll_s: float = 0.05,
    ) -> None:
        self._folder = folder
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
        _lower_priority()
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
                with self._cond:
                    if self._stop:
                        return
                    self._cond.wait(self._poll_s)
        finally:
            for seg in segs.values():
                seg.close()

    def _pass(self, ring: Ring, segs: dict[int, SegmentFile]) -> None:
        for lr in range(self._nproc):
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
                    why = push(peer, segs[lr], slot, rec, ring.me)
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
                self._peers.update(lookup(self._kv, ring.round, [node]))
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


def replica_ranks(folder: Path) -> list[int]:
    """Ranks this folder holds replicas of (for tests and the report)."""
    out = []
    for p in folder.glob(f"{REPLICA_PREFIX}*{rl.SEGMENT_SUFFIX}"):
        with contextlib.suppress(ValueError):
            out.append(int(p.name[len(REPLICA_PREFIX) : -len(rl.SEGMENT_SUFFIX)]))
    return sorted(out)


# -- the supervisor's handle -----------------------------------------------------------
_PEERS_WAIT_S = 5.0


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
    ) -> None:
        self.k = k
        self._kv = kv
        self._nproc = nproc
        self._emit = emit
        self._node = -1
        # In a steady ring this node holds the replicas of K nodes' ranks (as many as it
        # runs, with the same --nproc-per-node everywhere).
        reserve = min(k, max(0, max_nodes - 1)) * nproc
        self.holder = ReplicaHolder(folder, slot_bytes, emit, reserve=reserve)
        self.server = ReplicaServer(self.holder, addr, lambda: self._node)
        try:
            self.replicator = Replicator(folder, nproc, kv, emit)
        except BaseException:
            self.server.close()
            self.holder.close()
            raise

    def begin_round(
        self, round_: int, node: int, nodes: int, base_rank: int, world_size: int
    ) -> list[Fetched]:
        """Publish this node's server, point the sender at the new ring, and bring in
        the snapshots of ranks this node now runs and holds none of (after a node loss)."""
        self._node = node
        self.replicator.set_ring(None)
        publish(self._kv, round_, node, self.server.address)
        self.replicator.set_ring(Ring(round_, node, nodes, min(self.k, nodes - 1)))
        if round_ == 0 or nodes < 2:
            return []  # a new job: nobody holds anything yet
        others = [n for n in range(nodes) if n != node]
        deadline = time.monotonic() + _PEERS_WAIT_S
        peers = lookup(self._kv, round_, others)
        # Every node publishes right after it joins; a few ms apart.
        while len(peers) < len(others) and time.monotonic() < deadline:
            time.sleep(0.02)
            peers = lookup(self._kv, round_, others)
        ranks = [base_rank + lr for lr in range(self._nproc)]
        return fetch_missing(self.holder, ranks, world_size, peers, self._emit)

    def close(self) -> None:
        self.replicator.close()
        self.server.close()
        self.holder.close()
