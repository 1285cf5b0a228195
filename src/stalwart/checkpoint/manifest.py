"""The per-rank manifest: what a rank wrote for a step, with sizes and checksums.

Stored as JSON next to the data file. It is the commit record: written last,
its presence means the rank's data file was fully written and fsync'd.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any, Protocol

import msgspec

from .errors import CheckpointCorruptError

FORMAT_VERSION = 1
_READ_CHUNK = 16 << 20


class FileEntry(msgspec.Struct, frozen=True):
    size: int
    checksum: str
    algorithm: str


class Manifest(msgspec.Struct, frozen=True):
    format: int
    step: int
    rank: int
    world_size: int
    files: dict[str, FileEntry]
    created_unix: float
    metadata: dict[str, Any] = {}


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | memoryview, /) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def _have_xxhash() -> bool:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return False
    return True


def default_algorithm() -> str:
    """xxh3_64 when the optional ``xxhash`` package is installed (≈10× faster), else crc32."""
    return "xxh3_64" if _have_xxhash() else "crc32"


def new_hasher(algorithm: str) -> Hasher:
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "xxh3_64":
        try:
            import xxhash
        except ImportError as exc:
            raise CheckpointCorruptError(
                "manifest uses xxh3_64 but the 'xxhash' package is not installed"
            ) from exc
        h: Hasher = xxhash.xxh3_64()
        return h
    raise CheckpointCorruptError(f"unknown checksum algorithm {algorithm!r}")


def file_checksum(path: Path, algorithm: str) -> tuple[int, str]:
    """Size and checksum of a file, read in chunks."""
    hasher = new_hasher(algorithm)
    size = 0
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            hasher.update(view[:n])
            size += n
    return size, hasher.hexdigest()


def encode(manifest: Manifest) -> bytes:
    return msgspec.json.encode(manifest)


def read_manifest(path: Path) -> Manifest:
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"missing manifest {path}") from exc
    try:
        return msgspec.json.decode(raw, type=Manifest)
    except msgspec.DecodeError as exc:
        raise CheckpointCorruptError(f"unreadable manifest {path}: {exc}") from exc


def verify_files(folder: Path, manifest: Manifest) -> None:
    """Raise CheckpointCorruptError unless every listed file matches size and checksum."""
    if manifest.format != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{folder}: manifest format {manifest.format}, expected {FORMAT_VERSION}"
        )
    for name, entry in manifest.files.items():
        path = folder / name
        try:
            actual_size = os.stat(path).st_size
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{path} is missing") from exc
        if actual_size != entry.size:
            raise CheckpointCorruptError(
                f"{path}: size {actual_size} != {entry.size} recorded in the manifest"
            )
        _, digest = file_checksum(path, entry.algorithm)
        if digest != entry.checksum:
            raise CheckpointCorruptError(
                f"{path}: {entry.algorithm} {digest} != {entry.checksum} recorded in the manifest"
            )
