"""The writer subprocess's side of DCP shard files (see ``dcp_shards.py``).

Kept apart so the subprocess imports torch and stalwart's checksums only, not
``torch.distributed.checkpoint`` (which takes as long again to import): the writer's
start-up is on the first save's way to durable.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .manifest import DEFAULT_ALGORITHM, FileEntry, Hasher, new_hasher
from .streaming import start_writeback

FILES_KEY = "files"
# Writes at least this large start their writeback at once (the buffered stream in
# front hands over 1 MiB at a time, a tensor's data in one piece).
WRITEBACK_FROM = 1 << 20


class HashingFile(io.FileIO):
    """A file that hashes what is written to it, as long as it is written in order."""

    def __init__(self, path: Path, hasher: Hasher) -> None:
        super().__init__(path, "w")
        self._hasher = hasher
        self.size = 0
        self.in_order = True

    def write(self, b: Any, /) -> int:
        at = self.size
        n = super().write(b)
        if n:
            self._hasher.update(memoryview(b).cast("B")[:n])
            self.size += n
            if n >= WRITEBACK_FROM and self.in_order:
                # The disk starts on these bytes while the next record is serialized
                # and hashed; the fsync at the end then waits for the tail only.
                start_writeback(self.fileno(), at, n)
        return n

    def seek(self, pos: int, whence: int = os.SEEK_SET, /) -> int:
        at = super().seek(pos, whence)
        if at != self.size:
            # A writer that goes back would make the running hash wrong; the file
            # is then hashed again from disk once closed.
            self.in_order = False
        return at

    def digest(self) -> str:
        return self._hasher.hexdigest()


@dataclass(frozen=True)
class WrittenFile:
    """One shard file the subprocess wrote: each item's (offset, length), in the order
    given, and the file's size and checksum."""

    name: str
    extents: tuple[tuple[int, int], ...]
    entry: FileEntry


class ShardFileWriter:
    """Runs in the writer subprocess: writes one rank's shard files into ``path``."""

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM) -> None:
        new_hasher(algorithm)
        self.algorithm = algorithm

    def write(
        self, state_dict: Any, path: str, *, release: Callable[[], None], **kwargs: Any
    ) -> list[WrittenFile]:
        folder = Path(path)
        opened: list[tuple[str, HashingFile, tuple[tuple[int, int], ...]]] = []
        crc32 = torch.serialization.get_crc32_options()
        try:
            # Each file is hashed as written and that checksum is verified at load, so
            # the zip CRC32 torch.save computes per record is a second checksum of the
            # same bytes, and the slower one: 0.57 s per 256 MiB against 0.22 s for the
            # hash (measured, load 18). torch.load (and so dcp.load) reads records
            # without one.
            torch.serialization.set_crc32_options(False)
            for name, datas in state_dict[FILES_KEY]:
                if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
                    raise ValueError(f"shard file name {name!r}: expected a plain file name")
                raw = HashingFile(folder / name, new_hasher(self.algorithm))
                opened.append((name, raw, _write_items(raw, datas)))
            torch.serialization.set_crc32_options(crc32)
            # The shared buffer is read no more: the rank may stage its next save
            # while these files reach the disk.
            release()
            written: list[WrittenFile] = []
            for name, raw, extents in opened:
                os.fsync(raw.fileno())
                entry = FileEntry(raw.size, raw.digest(), self.algorithm)
                written.append(WrittenFile(name, extents, entry))
            return written
        finally:
            torch.serialization.set_crc32_options(crc32)
            for opened_file in opened:
                opened_file[1].close()


def _write_items(
    raw: HashingFile, datas: list[bytes | torch.Tensor]
) -> tuple[tuple[int, int], ...]:
    # DCP's format: byte items as they are, each tensor as one torch.save record.
    stream = io.BufferedWriter(raw, buffer_size=1 << 20)
    extents: list[tuple[int, int]] = []
    for data in datas:
        offset = stream.tell()
        if isinstance(data, bytes):
            stream.write(data)
        else:
            torch.save(data, stream)
        extents.append((offset, stream.tell() - offset))
    stream.flush()
    stream.detach()  # the raw file stays open for its fsync
    return tuple(extents)
