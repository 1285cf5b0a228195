"""Each launcher's replica server: it takes peers' pushes and serves its snapshots to
a node that fetches them. Its address is published in the job's store, MACed.

Everything a peer sends is hostile until it proved it is of the job (``auth``),
and bounded after: at most ``MAX_CONNECTIONS`` connections at once (``MAX_PER_HOST``
from one address), each closed when its handshake takes over ``HANDSHAKE_S`` or a
transfer falls below ``MIN_RATE`` bytes/s; nothing is allocated before the handshake,
and then only what the manifest declares, checked against the slot size. A connection
over a limit is closed at once, so a flood never holds the launcher's descriptors; a
full descriptor table (EMFILE) pauses accepting instead of ending the launcher.
Malformed input is logged as one line per kind, at most every ``_LOG_EVERY_S``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from stalwart.base.events import Event
from stalwart.launch.replicas import auth, wire
from stalwart.launch.replicas.ring import owner_problem
from stalwart.launch.replicas.segments import Emit, ReplicaHolder, send_slot
from stalwart.rendezvous.kv import listen_socket

logger = logging.getLogger(__name__)

#: Store key of a node's replica server in a round: JSON ``PeerAddress``.
STORE_KEY = "replicas/r{round}/{node}"
REPLICA_CONN_REFUSED = Event.REPLICA_CONN_REFUSED
# Replication yields to training on a contended core (the writer child runs at +5).
# Not +19: that weighs 15 against a busy nice-0 process's 1024 (CFS), so on a loaded
# host a replica could lag past the next snapshot, and one that lags by more than a
# generation shares no step with the survivors' own snapshots.
_NICE = 10
_CONNECT_TIMEOUT_S = 3.0
#: Connections served at once; a ring needs a few (K pushers, a spare's fetch).
MAX_CONNECTIONS = 16
MAX_PER_HOST = 4
#: A transfer gets 30 s plus its size at this rate: a trickle cannot hold a rank's slot.
MIN_RATE = 1 << 20
_TRANSFER_BASE_S = 30.0
_ACCEPT_POLL_S = 0.2
_EMFILE_PAUSE_S = 0.1
_LOG_EVERY_S = 10.0
_FULL_FD = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class KVLike(Protocol):
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...

    def set(self, key: str, value: str, *, leased: bool = False) -> None: ...


class PeerAddress(msgspec.Struct, frozen=True):
    """Where a node's server listens in a round and which ranks the node runs; ``mac``
    by the job's key (``replica_auth.address_mac``), so the store cannot forge it."""

    addr: str
    port: int
    node: int
    first_rank: int
    nranks: int
    world_size: int
    mac: str = ""

    def fields(self, round_: int) -> tuple[object, ...]:
        return (
            round_,
            self.addr,
            self.port,
            self.node,
            self.first_rank,
            self.nranks,
            self.world_size,
        )


def _no_delay(sock: socket.socket) -> None:
    # Small frames go back to back (a proof, then the request): without this, Nagle's
    # algorithm holds the second for the peer's delayed ACK (40 ms, measured).
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def transfer_deadline(nbytes: int) -> float:
    """When a transfer of ``nbytes`` started now must be done (``time.monotonic()``)."""
    return time.monotonic() + _TRANSFER_BASE_S + nbytes / MIN_RATE


def lower_priority() -> None:
    # Linux nice values are per thread: this lowers only the calling thread.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)


class OneLine:
    """Logs a kind of trouble as one line at most every ``every_s`` seconds (with how
    many were left out), and emits it as an event as often: a flood of bad input must
    not flood the log."""

    def __init__(self, emit: Emit | None, every_s: float = _LOG_EVERY_S) -> None:
        self._emit = emit
        self._every = every_s
        self._last: dict[str, float] = {}
        self._held: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def __call__(self, kind: str, message: str) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._every:
                self._held[kind] += 1
                return False
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        more = f" (and {held} more since)" if held else ""
        # One line of printable text, whatever the peer sent (no terminal escapes).
        line = "".join(c if c.isprintable() else "?" for c in " ".join(message.split()))[:300]
        logger.warning("replica server: %s%s", line, more)
        if self._emit is not None:
            self._emit(REPLICA_CONN_REFUSED, reason=kind, error=line, more=held)
        return True


class _Gate:
    """How many connections are served, in all and per address."""

    def __init__(self, total: int, per_host: int) -> None:
        self._total = total
        self._per_host = per_host
        self._by_host: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def enter(self, host: str) -> str:
        """'' when a connection from ``host`` may be served now, else why not."""
        with self._lock:
            if sum(self._by_host.values()) >= self._total:
                return f"{self._total} connections already served"
            if self._by_host[host] >= self._per_host:
                return f"{self._per_host} connections from {host} already served"
            self._by_host[host] += 1
            return ""

    def leave(self, host: str) -> None:
        with self._lock:
            self._by_host[host] -= 1
            if self._by_host[host] <= 0:
                del self._by_host[host]

    def count(self) -> int:
        with self._lock:
            return sum(self._by_host.values())


class ReplicaServer:
    """Accepts pushes of peers' snapshots and serves this node's to a node that asks."""

    def __init__(
        self,
        holder: ReplicaHolder,
        addr: str,
        node_rank: Callable[[], int],
        key: bytes,
        peer_of: Callable[[int, int], PeerAddress | None],
        emit: Emit | None = None,
    ) -> None:
        """``key``: the job's (``auth.job_key``); ``peer_of(round, node)``: the
        verified address a node published in a round (who owns which ranks)."""
        self.holder = holder
        self._key = key
        self._node_rank = node_rank
        self._peer_of = peer_of
        self.trouble = OneLine(emit)
        self._gate = _Gate(MAX_CONNECTIONS, MAX_PER_HOST)
        self._sock = listen_socket(addr, 0)
        self._sock.settimeout(_ACCEPT_POLL_S)
        self.port = int(self._sock.getsockname()[1])
        self.addr = addr
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._accept_loop, name="stalwart-replica-server", daemon=True
        )
        self._thread.start()

    def address(
        self, round_: int, node: int, first_rank: int, nranks: int, world_size: int
    ) -> PeerAddress:
        plain = PeerAddress(self.addr, self.port, node, first_rank, nranks, world_size)
        return msgspec.structs.replace(
            plain, mac=auth.address_mac(self._key, *plain.fields(round_))
        )

    def connections(self) -> int:
        """Connections being served now (for tests)."""
        return self._gate.count()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                if exc.errno in _FULL_FD:
                    # Waiting lets served connections end; the backlog keeps the rest.
                    self.trouble("descriptors", f"cannot accept a connection: {exc.strerror}")
                    self._stop.wait(_EMFILE_PAUSE_S)
                    continue
                self.trouble("accept", f"accept failed: {exc}")
                self._stop.wait(_EMFILE_PAUSE_S)
                continue
            host = str(peer[0])
            why = self._gate.enter(host)
            if why:
                conn.close()
                self.trouble("limit", f"closed a connection from {host}: {why}")
                continue
            try:
                threading.Thread(
                    target=self._handle,
                    args=(conn, host),
                    name="stalwart-replica-conn",
                    daemon=True,
                ).start()
            except RuntimeError as exc:  # no thread to be had: drop this one
                self._gate.leave(host)
                conn.close()
                self.trouble("threads", f"cannot serve {host}: {exc}")

    def _handle(self, conn: socket.socket, host: str) -> None:
        try:
            with conn:
                _no_delay(conn)
                conn.settimeout(auth.HANDSHAKE_S)
                self.serve(conn)
        except auth.AuthError as exc:
            self.trouble("auth", f"refused {host}: {exc}")
        except (OSError, wire.WireError) as exc:
            self.trouble("wire", f"connection from {host} ended: {exc}")
        except Exception as exc:  # nothing a peer sends may end the launcher
            self.trouble("error", f"connection from {host}: {type(exc).__name__}: {exc}")
        finally:
            self._gate.leave(host)

    def serve(self, sock: socket.socket) -> None:
        deadline = time.monotonic() + auth.HANDSHAKE_S
        node = auth.server_handshake(sock, self._key, deadline)
        sock.settimeout(wire.IO_TIMEOUT_S)
        first = wire.recv_frame(sock, deadline)
        if isinstance(first, wire.Push):
            why = self._refusal(node, first)
            if why:
                self.trouble("refused", f"refused a push from node {node}: {why}")
                wire.send_frame(sock, wire.Reply(False, why))
                return
            rec = first.manifest.record
            until = transfer_deadline(rec.skeleton_bytes + rec.tensor_bytes)
            # A push is background work; a fetch is not: a node's restart waits for it.
            lower_priority()
            self.holder.receive(sock, first.manifest, announce=True, deadline=until)
            return
        if not isinstance(first, wire.Fetch):
            raise wire.WireError(f"unexpected {type(first).__name__} frame")
        with self.holder.lock(first.rank):
            found = self.holder.newest(first.rank, first.world_size)
            if found is None:
                wire.send_frame(sock, wire.Offer(None))
                return
            seg, slot, rec = found
            try:
                # This node checked the record when it took it (or its own rank wrote
                # it): it vouches for it with the job's key.
                mac = auth.record_mac(self._key, rec)
                wire.send_frame(sock, wire.Offer(wire.Manifest(rec, self._node_rank(), mac)))
                if first.send:
                    wire.send_frame(sock, wire.End(send_slot(sock, seg, slot, rec)))
            finally:
                seg.close()

    def _refusal(self, node: int, push: wire.Push) -> str:
        """Why a push from ``node`` is not taken ('' when it is), before any allocation."""
        man = push.manifest
        try:
            wire.payload_sizes(man.record, self.holder.slot_bytes)
        except wire.WireError as exc:
            return str(exc)
        if man.from_node != node:
            return f"sent as node {man.from_node} by node {node}"
        if not auth.record_ok(self._key, man.record, man.mac):
            return f"rank {man.record.rank} step {man.record.step}: the record's MAC differs"
        peer = self._peer_of(push.round, node)
        owned = None if peer is None else (peer.first_rank, peer.nranks, peer.world_size)
        rec = man.record
        return owner_problem(owned, node, rec.rank, rec.world_size)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()


def publish(kv: KVLike, round_: int, address: PeerAddress) -> None:
    key = STORE_KEY.format(round=round_, node=address.node)
    kv.set(key, msgspec.json.encode(address).decode())


def lookup(
    kv: KVLike, round_: int, nodes: list[int], key: bytes, trouble: OneLine | None = None
) -> dict[int, PeerAddress]:
    """The published replica servers of ``nodes`` whose MAC holds (those not published
    yet, malformed or forged are absent)."""
    keys = [STORE_KEY.format(round=round_, node=n) for n in nodes]
    found: dict[int, PeerAddress] = {}
    for node, raw in zip(nodes, kv.get_many(keys), strict=True):
        if raw is None:
            continue
        problem = ""
        try:
            peer = msgspec.json.decode(raw[: wire.MAX_FRAME], type=PeerAddress)
        except msgspec.DecodeError as exc:
            problem = f"malformed ({str(exc)[:100]})"
        else:
            if peer.node != node or not auth.mac_ok(
                peer.mac, auth.address_mac(key, *peer.fields(round_))
            ):
                problem = "its MAC differs (not written by a node of this job)"
            else:
                found[node] = peer
        if problem:
            message = f"ignoring the replica address of node {node} in the store: {problem}"
            if trouble is not None:
                trouble("address", message)
            else:
                logger.warning("%s", message)
    return found


def connect(peer: PeerAddress, key: bytes, me: int) -> socket.socket:
    """A connection to a peer's server, both sides proven to be of the job."""
    sock = socket.create_connection((peer.addr, peer.port), timeout=_CONNECT_TIMEOUT_S)
    try:
        _no_delay(sock)
        sock.settimeout(auth.HANDSHAKE_S)
        auth.client_handshake(sock, key, me)
    except BaseException:
        sock.close()
        raise
    return sock
