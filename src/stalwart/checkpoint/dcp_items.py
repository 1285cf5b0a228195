"""One DCP tensor item copied from bytes already in memory straight into the tensor the
load planner hands over.

DCP's ``FileSystemReader`` reads each item with ``torch.load`` (a fresh allocation the
size of the item, filled by a copy) and then copies that into the destination: for a RAM
snapshot, whose bytes are already mapped and verified, that is two copies and a page fault
per fresh page where one copy does. A DCP item is a ``torch.save`` archive whose tensor
data is one stored record: ``torch.load(..., map_location="meta")`` reads only the
archive's small pickle and says where that record starts, so the data goes from the slot
to its destination in one copy. Anything else (another byte order, a layout this path
does not handle, a torch that does not report record offsets) is left to the caller's
usual read.
"""

from __future__ import annotations

import io
import struct
import sys
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from .errors import CheckpointCorruptError

#: A zip local file header (signature .. extra field length).
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")


class BlobFile(io.RawIOBase):
    """A read-only, seekable file over a slice of memory (no copy of it is made)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError(f"seek to {base + offset}: before the start")
        self._at = base + offset
        return self._at

    def readinto(self, buffer: Any) -> int:
        with memoryview(buffer) as out:
            n = max(0, min(out.nbytes, len(self._view) - self._at))
            out.cast("B")[:n] = self._view[self._at : self._at + n]
        self._at += n
        return n

    def close(self) -> None:
        self._view.release()
        super().close()


@dataclass(frozen=True)
class ItemLayout:
    """A saved tensor (on the meta device: dtype, shape, strides, storage offset) and
    the extent of its storage's bytes in the item."""

    tensor: torch.Tensor
    data_offset: int
    data_bytes: int


def native_order(blob: memoryview) -> bool:
    """Whether a ``torch.save`` archive was written in this machine's byte order (one
    without a byte-order record is, as ``torch.load`` assumes)."""
    try:
        with BlobFile(blob[:]) as f, zipfile.ZipFile(f) as z:
            infos = [i for i in z.infolist() if i.filename.endswith("/byteorder")]
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, EOFError) as exc:
        raise CheckpointCorruptError(f"a tensor item is not an archive: {exc}") from None
    if not infos:
        return True
    # Read from its local header, not with ZipFile.read: that checks a CRC32, and the
    # shard writer saves records without one (its own hash covers them).
    at = infos[0].header_offset
    head = bytes(blob[at : at + _LOCAL_HEADER.size])
    if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        raise CheckpointCorruptError("a tensor item's byte-order record has no header")
    name_len, extra_len = _LOCAL_HEADER.unpack(head)[-2:]
    start = at + _LOCAL_HEADER.size + name_len + extra_len
    order = bytes(blob[start : start + infos[0].file_size])
    return order.decode("ascii", "replace") == sys.byteorder


def locate(blob: memoryview) -> ItemLayout | None:
    """Where the tensor of a DCP item lies in ``blob``; None when this torch does not
    report it. Raises CheckpointCorruptError (one line) for bytes that are no tensor
    archive or point outside themselves."""
    try:
        with BlobFile(blob[:]) as f:
            tensor = torch.load(cast(IO[bytes], f), map_location="meta", weights_only=True)
    except Exception as exc:  # torch.load raises many kinds on garbage; each means "bad item"
        raise CheckpointCorruptError(
            f"a tensor item does not load: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointCorruptError(f"a tensor item holds a {type(tensor).__name__}")
    storage = tensor.untyped_storage()
    at = getattr(storage, "_checkpoint_offset", None)
    if not isinstance(at, int):
        return None
    nbytes = storage.nbytes()
    if at < 0 or at + nbytes > len(blob):
        raise CheckpointCorruptError(
            f"a tensor item's data at {at}+{nbytes} lies outside its {len(blob)} bytes"
        )
    return ItemLayout(tensor, at, nbytes)


def copy_item(blob: memoryview, req: ReadItem, planner: LoadPlanner) -> bool:
    """Copy tensor item ``req`` from its bytes ``blob`` (of this machine's byte order:
    see :func:`native_order`) into the planner's destination and commit it; False
    (nothing done) when the caller must read it the usual way: a dtype to convert, or a
    layout that is not one contiguous run on both sides."""
    found = locate(blob)
    if found is None:
        return False
    part = narrow_tensor_by_index(found.tensor, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if (
        target.size() != part.size()
        or target.dtype != part.dtype
        or not (part.is_contiguous() and target.is_contiguous())
    ):
        return False
    size = part.element_size()
    first = int(part.storage_offset())
    start = found.data_offset + first * size
    count = int(part.numel()) * size
    if first < 0 or start + count > found.data_offset + found.data_bytes:
        raise CheckpointCorruptError(
            f"a tensor item's slice {start}+{count} lies outside its data "
            f"{found.data_offset}+{found.data_bytes}"
        )
    if count:
        with warnings.catch_warnings():
            # The mapping is read-only and only read from: torch warns about any such buffer.
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(blob, dtype=torch.uint8, count=count, offset=start)
        target.reshape(-1).view(torch.uint8).copy_(src)
        del src  # lets go of the buffer export before the caller releases the view
    planner.commit_tensor(req, target)
    return True


def read_items(
    reader: FileSystemReader,
    plan: LoadPlan,
    planner: LoadPlanner,
    blob_of: Callable[[_StorageInfo], memoryview],
) -> None:
    """Read every item of ``plan`` out of memory (``blob_of``: an item's bytes, e.g. a
    view into a verified slot): a tensor item by one copy into its destination where
    :func:`copy_item` can, the rest (bytes, transformed or byte-swapped items, dtype
    conversions, strided slices) the way ``FileSystemReader.read_data`` reads them."""
    native: dict[str, bool] = {}
    for req in plan.items:
        info: _StorageInfo = reader.storage_data[req.storage_index]
        with blob_of(info) as blob:
            if req.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                _read_as_dcp(reader, req, planner, blob, info)
                continue
            if info.relative_path not in native:
                native[info.relative_path] = native_order(blob)
            if not (native[info.relative_path] and copy_item(blob, req, planner)):
                _read_as_dcp(reader, req, planner, blob, info)


def _read_as_dcp(
    reader: FileSystemReader,
    req: ReadItem,
    planner: LoadPlanner,
    blob: memoryview,
    info: _StorageInfo,
) -> None:
    """One item the way ``FileSystemReader.read_data`` reads it (its transforms,
    ``torch.load``, then a copy into the destination)."""
    with BlobFile(blob[:]) as raw:
        stream = reader.transforms.transform_load_stream(
            req, info.transform_descriptors or (), cast(IO[bytes], raw)
        )
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(stream.read(-1)))
            return
        seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))
        loaded = torch.load(seekable, map_location="cpu", weights_only=True)
    if not isinstance(loaded, torch.Tensor):
        raise CheckpointCorruptError(f"{info.relative_path}: an item holds no tensor")
    tensor = narrow_tensor_by_index(loaded, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise CheckpointCorruptError(
            f"{info.relative_path}: item {req.storage_index} is {tuple(tensor.size())}, "
            f"its destination {tuple(target.size())}"
        )
    target.copy_(tensor)
    planner.commit_tensor(req, target)
