"""Reading one DCP tensor item straight from bytes in memory: where its data lies, and
hostile bytes (a RAM slot another process of this user could have scribbled on, or
extents a peer sent) refused with one line."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from stalwart.checkpoint.dcp_items import locate, native_order
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
