"""Reading DCP's ``.metadata`` without trusting it.

DCP stores its global metadata as a pickle, and ``FileSystemReader`` unpickles it
with the full unpickler: a checkpoint folder someone else can write would run
their code in every rank. Here only the classes DCP's metadata is made of can be
built, and the result is checked for shape (every shard a plain file name inside
the folder, offsets and lengths non-negative integers) before DCP plans with it.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from .dcp_records import MAX_METADATA_BYTES, is_plain_name
from .errors import CheckpointCorruptError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # Maps a layout's name to torch's layout object through a lookup table.
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP metadata holds no persistent ids")


def loads_metadata(raw: bytes, where: str) -> Metadata:
    """Unpickle DCP metadata with the restricted unpickler and check its shape."""
    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # any malformed pickle raises something different
        raise CheckpointCorruptError(f"{where}: not DCP metadata: {exc}") from exc
    if not isinstance(md, Metadata):
        raise CheckpointCorruptError(
            f"{where}: holds a {type(md).__name__}, expected DCP's Metadata"
        )
    check_shape(md, where)
    return md


def check_shape(md: Metadata, where: str) -> None:
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise CheckpointCorruptError(f"{where}: metadata without its tables")
    for info in md.storage_data.values():
        if not isinstance(info, _StorageInfo):
            raise CheckpointCorruptError(
                f"{where}: storage entry {type(info).__name__}, expected a file slice"
            )
        if not isinstance(info.relative_path, str) or not is_plain_name(info.relative_path):
            raise CheckpointCorruptError(
                f"{where}: shard {info.relative_path!r}, expected a file name inside the folder"
            )
        for field in (info.offset, info.length):
            if type(field) is not int or field < 0:
                raise CheckpointCorruptError(
                    f"{where}: shard {info.relative_path!r} slice {field!r}, "
                    "expected a non-negative integer"
                )


def read_metadata(path: Path) -> Metadata:
    """Read and check a ``.metadata`` file, refusing one larger than any real one."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_METADATA_BYTES:
                raise CheckpointCorruptError(
                    f"{path}: {size} bytes, expected at most {MAX_METADATA_BYTES} for DCP metadata"
                )
            raw = f.read(MAX_METADATA_BYTES + 1)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{path} is missing") from exc
    except OSError as exc:
        raise CheckpointCorruptError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return loads_metadata(raw, str(path))


def shard_extents(md: Metadata) -> dict[str, int]:
    """How many bytes each shard file must hold at least, by the metadata."""
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        end = info.offset + info.length
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    return need
