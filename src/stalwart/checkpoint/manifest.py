"""The per-rank manifest: what a rank wrote for a step, with sizes and checksums.

Stored as JSON next to the data file. It is the commit record: written last,
its presence means the rank's data file was fully written and fsync'd.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import msgspec
import xxhash

from .errors import CheckpointCorruptError
from .layout import data_name, is_data_name

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


#: What new checkpoints are checksummed with (≈10× faster than crc32, which stays
#: readable and selectable).
DEFAULT_ALGORITHM = "xxh3_64"


def new_hasher(algorithm: str) -> Hasher:
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "xxh3_64":
        h: Hasher = xxhash.xxh3_64()
        return h
    raise CheckpointCorruptError(f"unknown checksum algorithm {algorithm!r}")


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one file at a path from another that replaced it."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def file_checksum(path: Path, algorithm: str) -> tuple[int, str]:
    """Size and checksum of a file, read in chunks."""
    size, digest, _ = _checksum(path, algorithm)
    return size, digest


def _checksum(path: Path, algorithm: str) -> tuple[int, str, tuple[int, int, int, int]]:
    hasher = new_hasher(algorithm)
    size = 0
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        identity = file_identity(os.fstat(f.fileno()))
        while True:
            n = f.readinto(buf)
            if not n:
                break
            hasher.update(view[:n])
            size += n
    return size, hasher.hexdigest(), identity


def encode(manifest: Manifest) -> bytes:
    return msgspec.json.encode(manifest)


def _why(exc: OSError) -> str:
    return f"{exc.strerror or exc} (errno {exc.errno})"


def read_manifest(path: Path) -> Manifest:
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"missing manifest {path}") from exc
    except OSError as exc:
        # Unreadable (EACCES, EISDIR, ELOOP, EIO...): this step is unusable,
        # an older one may not be, so it is reported like corruption.
        raise CheckpointCorruptError(f"cannot read manifest {path}: {_why(exc)}") from exc
    try:
        return msgspec.json.decode(raw, type=Manifest)
    except msgspec.DecodeError as exc:
        raise CheckpointCorruptError(f"unreadable manifest {path}: {exc}") from exc


def data_file(folder: Path, manifest: Manifest) -> str:
    """The name of the rank's data file the manifest vouches for.

    A manifest must list exactly one data file of its own rank and only plain
    names inside its folder; anything else (``"files": {}``, ``../x``) is a
    manifest no writer of ours produced, and nothing it lists is trusted.
    """
    for name in manifest.files:
        if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise CheckpointCorruptError(
                f"{folder}: manifest lists {name!r}, expected a file name inside the step folder"
            )
    names = [n for n in manifest.files if is_data_name(n, manifest.rank)]
    if len(names) != 1:
        raise CheckpointCorruptError(
            f"{folder}: manifest of rank {manifest.rank} lists {sorted(manifest.files)}, "
            f"expected exactly one data file like {data_name(manifest.rank)!r}"
        )
    return names[0]


def verify_files(folder: Path, manifest: Manifest) -> tuple[str, tuple[int, int, int, int]]:
    """Raise CheckpointCorruptError unless the manifest names this rank's data file
    and every listed file matches size and checksum; returns the data file's name
    and the identity (:func:`file_identity`) of the file that was checked."""
    if manifest.format != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{folder}: manifest format {manifest.format}, expected {FORMAT_VERSION}"
        )
    data = data_file(folder, manifest)
    identities = verify_entries(folder, manifest.files, "the manifest")
    return data, identities[data]


def verify_entries(
    folder: Path, files: Mapping[str, FileEntry], record: str
) -> dict[str, tuple[int, int, int, int]]:
    """Raise CheckpointCorruptError unless every file in ``files`` (names inside ``folder``)
    matches its size and checksum; ``record`` names where the entries came from, for the
    message. Returns each file's identity (:func:`file_identity`) as it was read."""
    identities: dict[str, tuple[int, int, int, int]] = {}
    for name, entry in files.items():
        path = folder / name
        try:
            size = os.stat(path).st_size
            if size != entry.size:
                raise CheckpointCorruptError(f"{path}: {size} bytes, {record} says {entry.size}")
            _, digest, identities[name] = _checksum(path, entry.algorithm)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{path} is missing") from exc
        except OSError as exc:
            raise CheckpointCorruptError(f"cannot read {path}: {_why(exc)}") from exc
        if digest != entry.checksum:
            raise CheckpointCorruptError(
                f"{path}: {entry.algorithm} {digest}, {record} says {entry.checksum}"
            )
    return identities
