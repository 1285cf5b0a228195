"""The byte stream snapshot replicas travel on between launchers, step by step.

One TCP connection per exchange; the client speaks first. Control messages are frames
(``[u32 length][msgspec JSON]``, at most ``MAX_FRAME`` bytes, tagged by ``kind``); a
snapshot's bytes follow its manifest raw, exactly as many as the manifest names::

    push   (a node hands its newest snapshot of a rank to a peer)
      1. client: Push(token, manifest)
      2. server: Reply(ok, error)  go ahead, or why not (no room, a slot too small)
      3. client: the skeleton bytes, then the tensor bytes
      4. client: End(ok)           ok: the source slot was unchanged after it was read
      5. server: Reply(ok, error)  ok: checksums match and the replica is committed
    fetch  (a node that takes over a rank asks a peer for its snapshot)
      1. client: Fetch(token, rank, world_size, send)
      2. server: Offer(manifest | None)
      3. if send and a manifest: server sends the bytes, then End(ok)

A wrong token is answered with Reply(False, "wrong token") in place of step 2.
The receiver of bytes always checks them against the manifest's checksums before it
commits them, so a torn or altered stream is dropped, never used. No pickle crosses the
wire: the manifest is JSON, and the snapshot bytes are what the worker wrote (its
skeleton is unpickled by the worker with the same restricted unpickler as a local one).
"""

from __future__ import annotations

import socket
import struct

import msgspec

from stalwart.checkpoint import ramlayout as rl

#: Largest control frame accepted: a manifest is a few hundred bytes.
MAX_FRAME = 64 << 10
_LEN = struct.Struct("<I")


class WireError(Exception):
    """The peer broke the protocol or the connection; the message says how."""


class Manifest(msgspec.Struct, frozen=True):
    """What a snapshot on the wire is: its commit record and the node it came from."""

    record: rl.CommitRecord
    from_node: int


class Push(msgspec.Struct, frozen=True, tag="push", tag_field="kind"):
    token: str
    manifest: Manifest


class Fetch(msgspec.Struct, frozen=True, tag="fetch", tag_field="kind"):
    token: str
    rank: int
    world_size: int
    send: bool  # False: only say what is held (the manifest)


class Offer(msgspec.Struct, frozen=True, tag="offer", tag_field="kind"):
    manifest: Manifest | None


class End(msgspec.Struct, frozen=True, tag="end", tag_field="kind"):
    ok: bool


class Reply(msgspec.Struct, frozen=True, tag="reply", tag_field="kind"):
    ok: bool
    error: str = ""


Message = Push | Fetch | Offer | End | Reply
_decoder = msgspec.json.Decoder(Message)


def send_frame(sock: socket.socket, msg: Message) -> None:
    body = msgspec.json.encode(msg)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the stream; a peer that closes early is a ``WireError``."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise WireError(f"connection closed after {got} of {len(view)} bytes")
        got += n


def recv_frame(sock: socket.socket) -> Message:
    head = bytearray(_LEN.size)
    recv_exact(sock, memoryview(head))
    (length,) = _LEN.unpack(head)
    if length > MAX_FRAME:
        raise WireError(f"frame of {length} bytes (at most {MAX_FRAME} expected)")
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    try:
        msg: Message = _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise WireError(f"bad frame: {exc}") from None
    return msg


def expect(sock: socket.socket, kind: type[Message]) -> Message:
    msg = recv_frame(sock)
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
