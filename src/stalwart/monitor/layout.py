"""The shared-memory segment: one fixed-layout slot per local rank.

Ranks write monotonic timestamps into their own slot with plain stores (no syscall);
the node monitor scans all slots. This module owns the byte layout and the only code
that creates, opens, reads or resets the segment. `time.monotonic()` is the system-wide
CLOCK_MONOTONIC on Linux, so timestamps written by one process compare with another's.

Slot layout (native byte order, all fields 8 bytes):
  0 pid          writer's pid, written last on attach (0 = nobody attached)
  8 beats        heartbeats sent since attach (the node monitor's warm-up counts them)
 16 state        SlotState
 24 attach_time  monotonic time of attach
 32 last_hb      monotonic time of the last heartbeat (0 = none yet)
 40 iteration    last reported iteration (-1 = none)
 48 oos_start    monotonic time the rank last left all sections
 56 hb_initial   learned/loaded overrides; 0 = use the node's config, inf = disabled
 64 hb
 72 oos
 80 last_section index of the most recently opened section (-1 = none)
 88 name_count   number of entries in the name table
128 open[32]     monotonic open time per section index (0 = closed)
384 limit[32]    per-section timeout override (same convention as above)
640 names[32]    48-byte NUL-padded UTF-8 section names
"""

from __future__ import annotations

import dataclasses
import enum
import mmap
import os
import struct
from pathlib import Path

from stalwart.monitor import envvars

MAGIC = b"STLWMON1"
VERSION = 1
MAX_SECTIONS = 32
NAME_BYTES = 48
HEADER_SIZE = 64
SLOT_SIZE = 4096

HEADER = struct.Struct("=8sIIII")
FIXED = struct.Struct("=qqqddqddddqq")
F64 = struct.Struct("=d")
I64 = struct.Struct("=q")
SECTIONS = struct.Struct(f"={MAX_SECTIONS}d")

OFF_PID = 0
OFF_BEATS = 8
OFF_STATE = 16
OFF_ATTACH = 24
OFF_LAST_HB = 32
OFF_ITERATION = 40
OFF_OOS_START = 48
OFF_HB_INITIAL = 56
OFF_HB = 64
OFF_OOS = 72
OFF_LAST_SECTION = 80
OFF_NAME_COUNT = 88
OFF_OPEN = 128
OFF_LIMIT = OFF_OPEN + 8 * MAX_SECTIONS
OFF_NAMES = OFF_LIMIT + 8 * MAX_SECTIONS
assert FIXED.size == OFF_NAME_COUNT + 8 and OFF_NAMES + NAME_BYTES * MAX_SECTIONS <= SLOT_SIZE


class SlotState(enum.IntEnum):
    FREE = 0
    ATTACHED = 1
    DETACHED = 2


class LayoutError(RuntimeError):
    """The segment is missing, foreign or of another version."""


def segment_size(nslots: int) -> int:
    return HEADER_SIZE + nslots * SLOT_SIZE


def slot_offset(index: int) -> int:
    return HEADER_SIZE + index * SLOT_SIZE


def create_segment(path: Path, nslots: int) -> mmap.mmap:
    """Creates a zeroed 0600 segment; fails if `path` already exists (never reuse one)."""
    if nslots < 1:
        raise ValueError(f"need at least one slot, got {nslots}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, segment_size(nslots))
        mm = mmap.mmap(fd, segment_size(nslots))
    finally:
        os.close(fd)
    reset_segment(mm, nslots)
    return mm


def reset_segment(mm: mmap.mmap, nslots: int) -> None:
    """Writes the header and empties every slot."""
    mm[0:HEADER_SIZE] = bytes(HEADER_SIZE)
    HEADER.pack_into(mm, 0, MAGIC, VERSION, nslots, SLOT_SIZE, MAX_SECTIONS)
    for i in range(nslots):
        reset_slot(mm, i)


def open_segment(path: Path | str) -> tuple[mmap.mmap, int]:
    """Maps an existing segment read-write and returns it with its slot count."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as exc:
        raise LayoutError(f"cannot open monitor segment {path}: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size < HEADER_SIZE:
            raise LayoutError(f"monitor segment {path} is truncated ({size} bytes)")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    magic, version, nslots, slot_size, max_sections = HEADER.unpack_from(mm, 0)
    if (magic, version, slot_size, max_sections) != (MAGIC, VERSION, SLOT_SIZE, MAX_SECTIONS):
        mm.close()
        raise LayoutError(f"{path} is not a stalwart monitor segment of version {VERSION}")
    if size < segment_size(nslots):
        mm.close()
        raise LayoutError(f"monitor segment {path} is truncated")
    return mm, int(nslots)


def reset_slot(mm: mmap.mmap, index: int) -> None:
    base = slot_offset(index)
    mm[base : base + SLOT_SIZE] = bytes(SLOT_SIZE)
    I64.pack_into(mm, base + OFF_ITERATION, -1)
    I64.pack_into(mm, base + OFF_LAST_SECTION, -1)


@dataclasses.dataclass(frozen=True)
class SlotSnapshot:
    """A consistent-enough copy of one slot, read by the scanner in three memcpys."""

    pid: int
    beats: int
    state: int
    attach_time: float
    last_hb: float
    iteration: int
    oos_start: float
    hb_initial_override: float
    hb_override: float
    oos_override: float
    last_section: int
    name_count: int
    open_times: tuple[float, ...]
    limits: tuple[float, ...]


def read_slot(mm: mmap.mmap, index: int) -> SlotSnapshot:
    base = slot_offset(index)
    (
        pid,
        beats,
        state,
        attach,
        last_hb,
        iteration,
        oos_start,
        hb_init,
        hb,
        oos,
        last,
        count,
    ) = FIXED.unpack_from(mm, base)
    return SlotSnapshot(
        pid,
        beats,
        state,
        attach,
        last_hb,
        iteration,
        oos_start,
        hb_init,
        hb,
        oos,
        last,
        count,
        open_times=SECTIONS.unpack_from(mm, base + OFF_OPEN),
        limits=SECTIONS.unpack_from(mm, base + OFF_LIMIT),
    )


def read_names(mm: mmap.mmap, index: int, count: int) -> list[str]:
    base = slot_offset(index) + OFF_NAMES
    names = []
    for i in range(min(max(count, 0), MAX_SECTIONS)):
        raw = mm[base + i * NAME_BYTES : base + (i + 1) * NAME_BYTES]
        names.append(raw.rstrip(b"\0").decode("utf-8", "replace"))
    return names


def write_name(mm: mmap.mmap | bytearray, index: int, position: int, name: str) -> None:
    data = name.encode("utf-8")
    if len(data) > NAME_BYTES:
        raise ValueError(f"section name {name!r} is longer than {NAME_BYTES} UTF-8 bytes")
    base = slot_offset(index) + OFF_NAMES + position * NAME_BYTES
    mm[base : base + NAME_BYTES] = data.ljust(NAME_BYTES, b"\0")


def slot_from_env() -> tuple[mmap.mmap, int] | None:
    """This process's (segment, slot index) from the environment, or None without one.

    Mappings are cached per process and path, so clients created one after another
    share one mmap.
    """
    path = os.environ.get(envvars.SHM_FILE)
    slot = os.environ.get(envvars.SLOT)
    if not path or slot is None:
        return None
    try:
        index = int(slot)
    except ValueError:
        raise LayoutError(f"{envvars.SLOT} must be an integer, got {slot!r}") from None
    key = (os.getpid(), path)
    cached = _mappings.get(key)
    if cached is None:
        cached = _mappings[key] = open_segment(path)
    mm, nslots = cached
    if not 0 <= index < nslots:
        raise LayoutError(f"{envvars.SLOT}={index} is outside the segment's {nslots} slots")
    return mm, index


_mappings: dict[tuple[int, str], tuple[mmap.mmap, int]] = {}
