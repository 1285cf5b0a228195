"""The byte stream snapshot replicas travel on between launchers, step by step.

One TCP connection per exchange; the client speaks first. Control messages are frames
(``[u32 length][msgspec JSON]``, at most ``MAX_FRAME`` bytes, tagged by ``kind``); a
snapshot's bytes follow its manifest raw, exactly as many as the manifest names.

Every connection starts with a mutual challenge-response over the job's key
(``auth``; the secret never passes through the store)::

      a. client: Hello(node, nonce)
      b. server: Challenge(nonce, proof)   the server knows the key
      c. client: Proof(proof)              the client knows the key (else: closed)

then one exchange::

    push   (a node hands its newest snapshot of one of its own ranks to a peer)
      1. client: Push(round, manifest) the manifest's record MACed by the owning node
      2. server: Reply(ok, error)      go ahead, or why not (not the sender's rank, no
                                       room, a slot too small, busy)
      3. client: the skeleton bytes, then the tensor bytes
      4. client: End(ok)               ok: the source slot was unchanged after it was read
      5. server: Reply(ok, error)      ok: checksums match and the replica is committed
    fetch  (a node that takes over a rank asks a peer for its snapshot)
      1. client: Fetch(rank, world_size, send)
      2. server: Offer(manifest | None)
      3. if send and a manifest: server sends the bytes, then End(ok)

The receiver of bytes checks the manifest's MAC, then the bytes against the record's
checksums before it commits them, so a torn, altered or forged stream is dropped, never
used. No pickle crosses the wire: the manifest is JSON, and the snapshot bytes are what
the worker wrote (its skeleton is unpickled by the worker with the same restricted
unpickler as a local one).
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Annotated

import msgspec

from stalwart.checkpoint import ramlayout as rl

#: Largest control frame accepted: a manifest is a few hundred bytes.
MAX_FRAME = 64 << 10
_LEN = struct.Struct("<I")
#: Longest wait for any one read or write of a peer's.
IO_TIMEOUT_S = 30.0


class WireError(Exception):
    """The peer broke the protocol or the connection; the message says how."""


#: Hex text of a nonce or an HMAC-SHA256 (the fields a handshake carries).
Hex = Annotated[str, msgspec.Meta(min_length=32, max_length=64, pattern="^[0-9a-f]+$")]
#: A rank, node or size read off the wire: never negative, never huge.
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 48)]


class Manifest(msgspec.Struct, frozen=True):
    """What a snapshot on the wire is: its commit record, the node it came from, and the
    MAC of the record by a node of the job (``auth.record_mac``)."""

    record: rl.CommitRecord
    from_node: Annotated[int, msgspec.Meta(ge=-1, le=1 << 48)]  # -1: before its first round
    mac: str = ""


class Hello(msgspec.Struct, frozen=True, tag="hello", tag_field="kind"):
    node: Count
    nonce: Hex


class Challenge(msgspec.Struct, frozen=True, tag="challenge", tag_field="kind"):
    nonce: Hex
    proof: Hex


class Proof(msgspec.Struct, frozen=True, tag="proof", tag_field="kind"):
    proof: Hex


class Push(msgspec.Struct, frozen=True, tag="push", tag_field="kind"):
    round: Count  # the round whose published addresses say which ranks the sender runs
    manifest: Manifest


class Fetch(msgspec.Struct, frozen=True, tag="fetch", tag_field="kind"):
    rank: Count
    world_size: Count
    send: bool  # False: only say what is held (the manifest)


class Offer(msgspec.Struct, frozen=True, tag="offer", tag_field="kind"):
    manifest: Manifest | None


class End(msgspec.Struct, frozen=True, tag="end", tag_field="kind"):
    ok: bool


class Reply(msgspec.Struct, frozen=True, tag="reply", tag_field="kind"):
    ok: bool
    error: str = ""


Message = Hello | Challenge | Proof | Push | Fetch | Offer | End | Reply
_decoder = msgspec.json.Decoder(Message)


def send_frame(sock: socket.socket, msg: Message) -> None:
    body = msgspec.json.encode(msg)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from the stream; a peer that closes early, or has not sent it all
    by ``deadline`` (``time.monotonic()``), is a ``WireError``."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WireError(f"too slow: {got} of {len(view)} bytes before the deadline")
            sock.settimeout(min(left, IO_TIMEOUT_S))
        n = sock.recv_into(view[got:])
        if n == 0:
            raise WireError(f"connection closed after {got} of {len(view)} bytes")
        got += n


def recv_frame(sock: socket.socket, deadline: float | None = None) -> Message:
    head = bytearray(_LEN.size)
    recv_exact(sock, memoryview(head), deadline)
    (length,) = _LEN.unpack(head)
    if length > MAX_FRAME:
        raise WireError(f"frame of {length} bytes (at most {MAX_FRAME} expected)")
    body = bytearray(length)
    recv_exact(sock, memoryview(body), deadline)
    try:
        msg: Message = _decoder.decode(body)
    except msgspec.DecodeError as exc:  # not JSON, or not one of the frames
        raise WireError(f"bad frame: {str(exc)[:200]}") from None
    return msg


def expect(sock: socket.socket, kind: type[Message], deadline: float | None = None) -> Message:
    msg = recv_frame(sock, deadline)
    if not isinstance(msg, kind):
        raise WireError(f"expected a {kind.__name__} frame, got {type(msg).__name__}")
    return msg


def payload_sizes(record: rl.CommitRecord, slot_bytes: int) -> tuple[int, int]:
    """(skeleton, tensor) bytes a manifest announces; raises when a slot cannot hold them."""
    if not 0 <= record.rank < record.world_size:
        raise WireError(f"rank {record.rank} is outside world size {record.world_size}")
    sizes_ok = (
        0 <= record.skeleton_bytes <= record.tensor_offset
        and record.tensor_offset % rl.PAGE == 0
        and record.tensor_bytes >= 0
        and record.tensor_offset + record.tensor_bytes <= slot_bytes
    )
    if not sizes_ok:
        raise WireError(
            f"snapshot of rank {record.rank} step {record.step}: "
            f"{record.tensor_offset + record.tensor_bytes} bytes do not fit a slot of "
            f"{slot_bytes} bytes (is --ckpt-ram the same on every node?)"
        )
    return record.skeleton_bytes, record.tensor_bytes
