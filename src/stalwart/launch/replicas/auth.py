"""Who may talk to a replica server: a node of this job, proven by its key.

The job's secret (``--job-secret-file`` or ``STALWART_JOB_SECRET``, the same on every
node, see ``config.secret``) never passes through the job's store, which anyone who
reaches its port can read. Each connection starts with a mutual challenge-response
(HMAC-SHA256 over both sides' fresh nonces, a different label per direction so neither
side's answer can be reflected back): the client learns that the server is of the job
before it sends a snapshot, the server that the client is before it allocates anything
or reads more than a few frames. The key is derived from the secret and the job's run
id, so two jobs that share a secret cannot replay into each other.

Records that travel on their own carry a MAC by the key: a snapshot's commit record
(what the owning rank committed: step, rank, sizes, checksums) and a node's published
server address (with the ranks it runs). A stranger who forges either in the store or
on the wire is found out by the reader.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import time

import msgspec

from stalwart.base.sealed import derive_key
from stalwart.base.sealed import mac_ok as mac_ok
from stalwart.checkpoint import ramlayout as rl
from stalwart.launch.replicas import wire


def _mac(key: bytes, label: str, *parts: object) -> str:
    """The hex HMAC-SHA256 of *parts* (records included, as msgspec encodes them) under
    *label*, a different one per use.  Here rather than in ``base.sealed``: ``base``
    stays free of third-party imports."""
    msg = msgspec.json.encode([label, *parts])
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


#: Seconds a peer has to prove itself, from the connection's accept.
HANDSHAKE_S = 5.0
_NONCE_BYTES = 16


class AuthError(wire.WireError):
    """The peer did not prove it is of this job; the message says how (one line)."""


def job_key(secret: bytes, run_id: str) -> bytes:
    """The key replicas use, derived from the job's secret and run id."""
    return derive_key(secret, "stalwart-replicas/1", run_id)


def record_mac(key: bytes, rec: rl.CommitRecord) -> str:
    """The MAC of what a rank committed; ``seq`` is left out (each holder renumbers)."""
    return _mac(key, "record", msgspec.structs.replace(rec, seq=0))


def record_ok(key: bytes, rec: rl.CommitRecord, mac: str) -> bool:
    return mac_ok(mac, record_mac(key, rec))


def address_mac(key: bytes, *fields: object) -> str:
    """The MAC of a published address: its round and every field but the MAC."""
    return _mac(key, "address", *fields)


def server_handshake(sock: socket.socket, key: bytes, deadline: float) -> int:
    """Answer a client's Hello and check its proof; returns the node it says it is."""
    hello = wire.expect(sock, wire.Hello, deadline)
    assert isinstance(hello, wire.Hello)
    mine = secrets.token_hex(_NONCE_BYTES)
    wire.send_frame(sock, wire.Challenge(mine, _mac(key, "server", hello.nonce, mine)))
    got = wire.expect(sock, wire.Proof, deadline)
    assert isinstance(got, wire.Proof)
    if not hmac.compare_digest(got.proof, _mac(key, "client", hello.nonce, mine, hello.node)):
        raise AuthError("wrong proof: not a node of this job (is the job secret the same?)")
    return hello.node


def client_handshake(sock: socket.socket, key: bytes, node: int) -> None:
    """Prove this node to a server and check that the server is of the job."""
    deadline = time.monotonic() + HANDSHAKE_S
    mine = secrets.token_hex(_NONCE_BYTES)
    wire.send_frame(sock, wire.Hello(node, mine))
    ch = wire.expect(sock, wire.Challenge, deadline)
    assert isinstance(ch, wire.Challenge)
    if not hmac.compare_digest(ch.proof, _mac(key, "server", mine, ch.nonce)):
        raise AuthError("the server did not prove it is of this job (is the job secret the same?)")
    wire.send_frame(sock, wire.Proof(_mac(key, "client", mine, ch.nonce, node)))
    sock.settimeout(wire.IO_TIMEOUT_S)
