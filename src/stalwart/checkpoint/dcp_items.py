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
import pickle
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
    found = read_layout(blob) or locate(blob)
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


#: ``torch.save``'s storage classes by name, and the dtype each holds.
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for dtype, name in torch.storage._dtype_to_storage_type_map().items()
    if not name.startswith("Q")  # quantized storages carry more than bytes
}
#: A tensor item's pickle is a few hundred bytes; a longer one takes torch.load's path.
_MAX_PICKLE_BYTES = 4096


@dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass(frozen=True)
class _Rebuilt:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not (isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value)):
        raise pickle.UnpicklingError(f"{what}: expected a tuple of non-negative ints")
    return value


def _rebuild(
    storage: object,
    offset: object,
    size: object,
    stride: object,
    requires_grad: object,
    hooks: object,
    *rest: object,
) -> _Rebuilt:
    if not isinstance(storage, _Storage) or type(offset) is not int or offset < 0:
        raise pickle.UnpicklingError("a tensor without its storage or with a bad offset")
    if hooks != {} or any(r is not None and r != {} for r in rest):
        raise pickle.UnpicklingError("a tensor with hooks or metadata")
    return _Rebuilt(storage, offset, _ints(size, "size"), _ints(stride, "stride"))


class _ItemUnpickler(pickle.Unpickler):
    """The pickle of one plainly saved tensor, and nothing else: the globals it may name
    are torch's tensor rebuild function, storage classes and an empty OrderedDict (its
    hooks); anything else is refused before it is looked up, so nothing is imported or
    called on behalf of the bytes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module[:40]}.{name[:40]} is not a tensor's part")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("a persistent id that is not a storage")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, torch.dtype) or not isinstance(key, str) or type(numel) is not int:
            raise pickle.UnpicklingError("a storage of unknown type")
        if numel < 0 or not key.isdigit() or len(key) > 20:
            raise pickle.UnpicklingError("a storage with a bad key or size")
        return _Storage(dtype, key, numel)


def _record(blob: memoryview, info: zipfile.ZipInfo) -> tuple[int, int]:
    """(offset, length) of a stored (uncompressed) zip record's bytes in ``blob``, read
    from its local header (not with ZipFile.read, which checks a CRC32 the shard writer
    does not write: its own hash covers the file)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointCorruptError(f"a tensor item's record {info.filename[:80]!r} is compressed")
    at = info.header_offset
    head = bytes(blob[at : at + _LOCAL_HEADER.size])
    if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        raise CheckpointCorruptError(f"a tensor item's record {info.filename[:80]!r} has no header")
    name_len, extra_len = _LOCAL_HEADER.unpack(head)[-2:]
    start = at + _LOCAL_HEADER.size + name_len + extra_len
    if start + info.file_size > len(blob):
        raise CheckpointCorruptError(
            f"a tensor item's record {info.filename[:80]!r} lies outside its {len(blob)} bytes"
        )
    return start, info.file_size


def read_layout(blob: memoryview) -> ItemLayout | None:
    """:func:`locate` without ``torch.load`` for a plainly saved tensor: its pickle read by
    a restricted unpickler that only names its parts, the data record found in the
    archive's directory. ``torch.load`` costs about 3 ms an item (setting up its archive
    reader, its Python unpickler), 0.3 s for the 96 items of a rank of the benchmark's
    FSDP2 job; this is a fraction of that. None: not such a tensor (the caller uses
    :func:`locate`)."""
    try:
        with BlobFile(blob[:]) as f, zipfile.ZipFile(f) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, EOFError) as exc:
        raise CheckpointCorruptError(f"a tensor item is not an archive: {exc}") from None
    pickles = [i for i in infos if i.filename.endswith("/data.pkl")]
    if len(pickles) != 1 or pickles[0].file_size > _MAX_PICKLE_BYTES:
        return None
    prefix = pickles[0].filename[: -len("data.pkl")]
    start, length = _record(blob, pickles[0])
    try:
        got = _ItemUnpickler(io.BytesIO(bytes(blob[start : start + length]))).load()
    except Exception:  # anything odd in the pickle: torch.load's path decides
        return None
    if not isinstance(got, _Rebuilt) or len(got.size) != len(got.stride):
        return None
    data = [i for i in infos if i.filename == f"{prefix}data/{got.storage.key}"]
    if len(data) != 1:
        raise CheckpointCorruptError(f"a tensor item lacks its data record {got.storage.key!r}")
    at, nbytes = _record(blob, data[0])
    itemsize = got.storage.dtype.itemsize
    if nbytes != got.storage.numel * itemsize:
        raise CheckpointCorruptError(
            f"a tensor item's data record is {nbytes} bytes, its storage "
            f"{got.storage.numel} x {itemsize}"
        )
    if all(got.size):
        last = got.offset + sum((n - 1) * st for n, st in zip(got.size, got.stride, strict=True))
        if last >= got.storage.numel:
            raise CheckpointCorruptError(
                f"a tensor item's view reaches element {last}, outside its storage of "
                f"{got.storage.numel}"
            )
    tensor = torch.empty(got.storage.numel, dtype=got.storage.dtype, device="meta")
    tensor = tensor.as_strided(got.size, got.stride, got.offset)
    return ItemLayout(tensor, at, nbytes)
