"""Each launcher's replica server: it takes peers' pushes and serves its snapshots to
a node that fetches them. Its address is published in the job's store."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Protocol

import msgspec

from stalwart.launch import replicawire as wire
from stalwart.launch.replica_segments import ReplicaHolder, send_slot
from stalwart.rendezvous.kv import listen_socket

logger = logging.getLogger(__name__)

#: Store key of a node's replica server in a round: JSON ``PeerAddress``.
STORE_KEY = "replicas/r{round}/{node}"
# Replication yields to training on a contended core (the writer child runs at +5).
# Not +19: that weighs 15 against a busy nice-0 process's 1024 (CFS), so on a loaded
# host a replica could lag past the next snapshot, and one that lags by more than a
# generation shares no step with the survivors' own snapshots.
_NICE = 10
_CONNECT_TIMEOUT_S = 3.0
_IO_TIMEOUT_S = 30.0


class KVLike(Protocol):
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...

    def set(self, key: str, value: str, *, leased: bool = False) -> None: ...


class PeerAddress(msgspec.Struct, frozen=True):
    addr: str
    port: int
    token: str  # only requests that carry it are served


def lower_priority() -> None:
    # Linux nice values are per thread: this lowers only the calling thread.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)


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
            lower_priority()
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


def connect(peer: PeerAddress) -> socket.socket:
    sock = socket.create_connection((peer.addr, peer.port), timeout=_CONNECT_TIMEOUT_S)
    sock.settimeout(_IO_TIMEOUT_S)
    return sock
