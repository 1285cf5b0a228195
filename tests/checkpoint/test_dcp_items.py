"""Reading one DCP tensor item straight from bytes in memory: where its data lies, and
hostile bytes (a RAM slot another process of this user could have scribbled on, or
extents a peer sent) refused with one line."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from stalwart.checkpoint.dcp_items import locate, native_order, read_layout
from stalwart.checkpoint.errors import CheckpointCorruptError

pytestmark = pytest.mark.timeout(60)


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_locate_finds_the_data_of_a_strided_slice() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)[1:3]
    raw = _saved(t)
    found = locate(memoryview(raw))
    assert found is not None
    meta = found.tensor
    assert (meta.shape, meta.stride(), meta.storage_offset(), meta.dtype) == (
        t.shape, t.stride(), t.storage_offset(), t.dtype
    )  # fmt: skip
    data = bytearray(raw[found.data_offset : found.data_offset + found.data_bytes])
    src = torch.frombuffer(data, dtype=torch.float32)
    assert torch.equal(src.as_strided(meta.shape, meta.stride(), meta.storage_offset()), t)
    assert native_order(memoryview(raw))


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"", "does not load"),
        (b"\x00" * 4096, "does not load"),
        (_saved(torch.ones(8))[:-30], "does not load"),  # cut short: no central directory
        (_saved({"not": "a tensor"}), "holds a dict"),
        (pickle.dumps(torch.ones(2)), "does not load"),  # a plain pickle is no archive
        (_saved(torch.ones(8)).replace(b"little", b"middle"), "does not load"),
    ],
)
def test_hostile_items_are_refused_in_one_line(raw: bytes, problem: str) -> None:
    with pytest.raises(CheckpointCorruptError, match=problem) as info:
        locate(memoryview(raw))
    assert "\n" not in str(info.value)


def test_an_item_that_is_no_archive_has_no_byte_order() -> None:
    with pytest.raises(CheckpointCorruptError, match="not an archive"):
        native_order(memoryview(b"garbage" * 10))


def test_byte_order_of_an_item_without_zip_crc() -> None:
    """The shard writer saves records without a CRC32 (zipfile's read would refuse them)."""
    was = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        raw = _saved(torch.ones(8))
    finally:
        torch.serialization.set_crc32_options(was)
    assert native_order(memoryview(raw))
    assert not native_order(memoryview(raw.replace(b"little", b"big\0\0\0")))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(24, dtype=torch.float32).reshape(4, 6)[1:3],  # a slice: offset 6
        torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).T,  # strided
        torch.tensor(3.5, dtype=torch.float64),  # 0-d
        torch.zeros(0, 5, dtype=torch.int64),  # empty
        torch.ones(7, dtype=torch.bool),
        torch.arange(10, dtype=torch.int8)[::3],
    ],
)
def test_read_layout_agrees_with_torch_load(tensor: torch.Tensor) -> None:
    raw = memoryview(_saved(tensor))
    fast, slow = read_layout(raw), locate(raw)
    assert fast is not None and slow is not None
    assert (fast.data_offset, fast.data_bytes) == (slow.data_offset, slow.data_bytes)
    f, s = fast.tensor, slow.tensor
    assert (f.shape, f.stride(), f.storage_offset(), f.dtype, f.device.type) == (
        s.shape, s.stride(), s.storage_offset(), s.dtype, "meta"
    )  # fmt: skip


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("unpickled",))


def _with_pickle(raw: bytes, new: bytes) -> bytes:
    """``raw`` (a torch.save archive) with its data.pkl record replaced by ``new`` of the
    same length (a stored record: the bytes sit in the file as they are)."""
    import zipfile

    z = zipfile.ZipFile(io.BytesIO(raw))
    (info,) = [i for i in z.infolist() if i.filename.endswith("/data.pkl")]
    old = z.read(info)
    assert len(new) <= len(old)
    return raw.replace(old, new.ljust(len(old), b"."), 1)


@pytest.mark.parametrize(
    "pkl",
    [
        pickle.dumps(_Boom(), protocol=2),  # names a global that is no tensor part
        b"cos\nsystem\n(S'true'\ntR.",  # os.system: never looked up, never called
        pickle.dumps([1, 2, 3], protocol=2),  # no tensor
        b"\x80\x02X\x07\x00\x00\x00storageq\x00Q.",  # a persistent id that is no tuple
    ],
)
def test_read_layout_leaves_anything_else_to_torch_load(
    pkl: bytes, capfd: pytest.CaptureFixture[str]
) -> None:
    raw = _with_pickle(_saved(torch.ones(64)), pkl)
    assert read_layout(memoryview(raw)) is None
    assert "unpickled" not in capfd.readouterr().out


def test_read_layout_refuses_a_data_record_of_the_wrong_size() -> None:
    raw = _saved(torch.ones(64))
    # The pickle says 64 elements; say 65 (K = BININT1 before the storage's tuple end).
    forged = raw.replace(b"K@t", b"KAt", 1)
    assert forged != raw
    with pytest.raises(CheckpointCorruptError, match="data record is 256 bytes") as info:
        read_layout(memoryview(forged))
    assert "\n" not in str(info.value)


def test_read_layout_refuses_a_view_past_its_storage() -> None:
    raw = _saved(torch.ones(64))
    # Storage offset 0 -> 9 (K\x00 is the first int after the persistent id): 9 + 64 > 64.
    forged = raw.replace(b"QK\x00", b"QK\x09", 1)
    assert forged != raw
    with pytest.raises(CheckpointCorruptError, match="outside its storage"):
        read_layout(memoryview(forged))
