"""The launcher-owned snapshot memory: its environment variable, files and commit records.

Both sides import this module: the launcher (``stalwart.launch.replicas.snapshots``) creates the
segments, the worker (``stalwart.checkpoint.ram``) writes and reads snapshots in them.
It imports neither torch nor the launcher, so the launcher stays torch-free.

One folder per launcher (0700, in ``/dev/shm``) holds one segment file per local rank
(0600). A segment holds ``GENERATIONS`` slots; each slot is a fixed-size header followed
by the snapshot: the pickled skeleton (tensors replaced by references), then, from a
page boundary, the tensor bytes. A slot's header is its commit record, written last::

    [u64 record length][u64 xxh3 of the record][record: JSON]   (0 length: no snapshot)

so a snapshot whose copy was cut short (the worker was killed) has no valid header and
is never used; the other slot still holds the previous committed snapshot.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import xxhash

#: Folder of the launcher's snapshot segments; unset outside ``stalwart run --ckpt-ram``.
RAM_DIR_ENV = "STALWART_CKPT_RAM_DIR"
#: Snapshot slots per local rank: the newest committed one survives a torn copy.
GENERATIONS = 2
#: Bytes reserved for a slot's commit record.
SLOT_HEADER = 4096
PAGE = 4096
FORMAT = "stalwart-ram/1"
SEGMENT_SUFFIX = ".snap"
#: Present in the folder while the launcher copies in snapshots from peers (a node that
#: took over a lost node's ranks): a restore waits for it to go before it looks.
FETCHING_MARKER = ".fetching"
_PREFIX = struct.Struct("<QQ")
#: What a slot holds: a state dict (skeleton + tensor bytes, ``ram``) or one rank's share
#: of a DCP step (shard index + shard files and metadata, ``dcp_ram``).
KIND_STATE = "state"
KIND_DCP = "dcp-shards"


class CommitRecord(msgspec.Struct, frozen=True):
    """What one slot holds; present (and hashing right) only once the copy is complete."""

    format: str
    step: int
    rank: int
    world_size: int
    seq: int  # increases with every snapshot of a segment; the newest wins a tie of steps
    skeleton_bytes: int
    skeleton_hash: int
    tensor_offset: int  # from the slot's data start, a page boundary after the skeleton
    tensor_bytes: int
    tensor_hash: int  # xxh3_64 of the tensor region, gaps included
    created_unix: float
    # Last, with a default: records written before kinds existed read as state dicts.
    kind: str = KIND_STATE


def segment_name(local_rank: int) -> str:
    return f"local_{local_rank}{SEGMENT_SUFFIX}"


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def slot_stride(slot_bytes: int) -> int:
    return SLOT_HEADER + round_up(slot_bytes, PAGE)


def segment_bytes(slot_bytes: int) -> int:
    """Size of one local rank's segment that holds snapshots of up to ``slot_bytes``."""
    return GENERATIONS * slot_stride(slot_bytes)


def slot_capacity(segment_size: int) -> int:
    """The snapshot bytes each slot of a segment of ``segment_size`` holds."""
    return max(0, segment_size // GENERATIONS - SLOT_HEADER)


def segment_problem(size: int) -> str:
    """Why a segment file of ``size`` bytes is not one ``segment_bytes`` made, or ''."""
    slot = slot_capacity(size)
    if slot < PAGE:
        return f"{size} bytes is too small for a snapshot segment"
    if segment_bytes(slot) != size:
        return (
            f"{size} bytes is not a whole segment (truncated or extended: "
            f"{segment_bytes(slot)} expected for slots of {slot} bytes)"
        )
    return ""


def header_offset(slot: int, slot_bytes: int) -> int:
    return slot * slot_stride(slot_bytes)


def data_offset(slot: int, slot_bytes: int) -> int:
    return header_offset(slot, slot_bytes) + SLOT_HEADER


def encode_header(record: CommitRecord) -> bytes:
    body = msgspec.json.encode(record)
    if _PREFIX.size + len(body) > SLOT_HEADER:
        raise ValueError(f"commit record of {len(body)} bytes does not fit a slot header")
    return _PREFIX.pack(len(body), xxhash.xxh3_64_intdigest(body)) + body


def split_header(record: CommitRecord) -> tuple[bytes, bytes]:
    """(prefix, body): the body is written first, the 16-byte prefix last (the commit)."""
    encoded = encode_header(record)
    return encoded[: _PREFIX.size], encoded[_PREFIX.size :]


PREFIX_BYTES = _PREFIX.size
EMPTY_PREFIX = bytes(_PREFIX.size)


def decode_header(raw: bytes) -> CommitRecord | None:
    """The record a slot header holds, or None when it is empty, torn or not ours."""
    if len(raw) < _PREFIX.size:
        return None
    length, digest = _PREFIX.unpack_from(raw)
    if length == 0 or _PREFIX.size + length > min(len(raw), SLOT_HEADER):
        return None
    body = raw[_PREFIX.size : _PREFIX.size + length]
    if xxhash.xxh3_64_intdigest(body) != digest:
        return None
    try:
        record = msgspec.json.decode(body, type=CommitRecord)
    except msgspec.ValidationError:
        return None
    return record if record.format == FORMAT else None


def room_error(wanted: int, free_in_folder: int, memory_available: int, where: str) -> str | None:
    """Why ``wanted`` bytes of snapshot memory cannot be reserved, or None when they can.

    ``free_in_folder``: what the RAM file system (``/dev/shm``) still holds;
    ``memory_available``: what the host can give without swapping or killing.
    """
    gib = 1 << 30
    if wanted > free_in_folder:
        return (
            f"needs {wanted / gib:.2f} GiB of snapshot memory but {where} has "
            f"{free_in_folder / gib:.2f} GiB free"
        )
    if wanted > memory_available:
        return (
            f"needs {wanted / gib:.2f} GiB of snapshot memory but only "
            f"{memory_available / gib:.2f} GiB of memory is available"
        )
    return None


def slot_record(buf: Any, slot: int, slot_bytes: int) -> CommitRecord | None:
    """The record slot ``slot`` of a mapped segment ``buf`` holds (see ``decode_header``)."""
    at = header_offset(slot, slot_bytes)
    return decode_header(buf[at : at + SLOT_HEADER])


def committed_slots(buf: Any, slot_bytes: int) -> list[tuple[int, CommitRecord]]:
    """The committed slots of a mapped segment, newest (highest seq) first."""
    found = [
        (s, r) for s in range(GENERATIONS) if (r := slot_record(buf, s, slot_bytes)) is not None
    ]
    return sorted(found, key=lambda sr: sr[1].seq, reverse=True)
