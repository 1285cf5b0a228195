"""The writer's output streams: O_DIRECT through reused chunks, and the buffered fallback."""

from __future__ import annotations

import mmap
import os
import random
import zlib
from pathlib import Path

import pytest
import torch

from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig, load_latest
from stalwart.checkpoint.manifest import new_hasher
from stalwart.checkpoint.streaming import DIRECT_ALIGN, ChunkPool, DirectStream, open_output

_CHUNK = 16 * DIRECT_ALIGN


def _supports_o_direct(folder: Path) -> bool:
    probe = folder / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return hasattr(os, "O_DIRECT")


def _write_pieces(path: Path, pieces: list[bytes], pool: ChunkPool) -> tuple[int, str, bool]:
    hasher = new_hasher("crc32")
    out = open_output(str(path), hasher, pool)
    try:
        for piece in pieces:
            assert out.write(memoryview(piece)) == len(piece)
        size = out.finish()
        os.fsync(out.fileno())
    finally:
        out.close()
    return size, hasher.hexdigest(), out.direct


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "sizes",
    [
        [],  # empty file
        [1],  # only an unaligned tail
        [DIRECT_ALIGN],  # exactly one block, no tail
        [_CHUNK],  # exactly one chunk
        [_CHUNK * 3 + 17],  # one write spanning several chunks, with a tail
        "random",  # many writes of every size, crossing chunk borders anywhere
    ],
)
def test_direct_stream_writes_exactly_the_bytes_it_hashes(
    tmp_path: Path, sizes: list[int] | str
) -> None:
    if not _supports_o_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    rng = random.Random(7)
    if sizes == "random":
        sizes = [rng.choice([0, 1, 63, 4095, 4097, _CHUNK - 1, _CHUNK + 5]) for _ in range(40)]
    assert isinstance(sizes, list)
    pieces = [rng.randbytes(n) for n in sizes]
    expected = b"".join(pieces)
    # Two small chunks force the writer to wait for the I/O thread to hand chunks back.
    pool = ChunkPool(chunk_bytes=_CHUNK, count=2)
    size, digest, direct = _write_pieces(tmp_path / "f.bin", pieces, pool)
    assert direct
    assert size == len(expected)
    assert (tmp_path / "f.bin").read_bytes() == expected
    assert digest == f"{zlib.crc32(expected):08x}"
    # The pool is reused by the next file, as the writer does for every save.
    size2, _, _ = _write_pieces(tmp_path / "g.bin", [b"x" * 5000], pool)
    assert (tmp_path / "g.bin").read_bytes() == b"x" * 5000 and size2 == 5000


@pytest.mark.timeout(60)
def test_direct_stream_reports_a_write_error_from_its_io_thread(tmp_path: Path) -> None:
    if not _supports_o_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    path = tmp_path / "ro.bin"
    path.write_bytes(b"")
    # A read-only descriptor: every pwrite fails with EBADF on the I/O thread.
    fd = os.open(path, os.O_RDONLY)
    stream = DirectStream(fd, ChunkPool(chunk_bytes=_CHUNK, count=2), new_hasher("crc32"))
    try:
        with pytest.raises(OSError):
            for _ in range(8):
                stream.write(b"y" * _CHUNK)
            stream.finish()
    finally:
        stream.close()


@pytest.mark.timeout(60)
def test_saves_use_direct_io_by_default_and_load_with_plain_torch_load(tmp_path: Path) -> None:
    if not _supports_o_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    # Odd sizes: the file ends in a partial block, written through the page cache.
    state = {"a": torch.randn(3 * (1 << 20) + 3), "b": torch.arange(7, dtype=torch.int16)}
    with AsyncCheckpointer(tmp_path, keep_last=2, rank=0, world_size=1) as ckpt:
        result = ckpt.save(state, step=1).result(timeout=30)
    assert result.direct_io
    assert result.nbytes == result.path.stat().st_size
    assert result.nbytes % DIRECT_ALIGN != 0
    loaded = torch.load(result.path, weights_only=True)
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])
    found = load_latest(tmp_path, rank=0)  # verifies the manifest checksum
    assert found is not None and found.step == 1


@pytest.mark.timeout(60)
def test_buffered_writes_when_direct_io_is_off(tmp_path: Path) -> None:
    state = {"a": torch.randn(1 << 18)}
    cfg = CheckpointerConfig(direct_io=False)
    with AsyncCheckpointer(tmp_path, keep_last=2, rank=0, world_size=1, config=cfg) as ckpt:
        result = ckpt.save(state, step=1).result(timeout=30)
    assert not result.direct_io
    found = load_latest(tmp_path, rank=0)
    assert found is not None and torch.equal(found.state_dict["a"], state["a"])


@pytest.mark.timeout(60)
def test_aligned_large_writes_go_to_disk_without_a_copy(tmp_path: Path) -> None:
    if not _supports_o_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    rng = random.Random(3)
    big = mmap.mmap(-1, 40 * DIRECT_ALIGN)  # page-aligned, like the staging buffer
    big.write(rng.randbytes(len(big)))
    head = rng.randbytes(DIRECT_ALIGN)  # brings the file offset to a block boundary
    odd = bytearray(rng.randbytes(20 * DIRECT_ALIGN + 1))
    hasher = new_hasher("crc32")
    out = open_output(str(tmp_path / "f.bin"), hasher, ChunkPool(chunk_bytes=_CHUNK, count=2))
    assert isinstance(out, DirectStream)
    try:
        out.write(head)
        # Aligned address at an aligned offset, 7 bytes short of a block multiple:
        # all but the last partial block is written in place.
        out.write(memoryview(big)[: len(big) - 7])
        assert out.zero_copy_bytes == len(big) - DIRECT_ALIGN
        # Misaligned address (odd offset into a bytearray): copied.
        out.write(memoryview(odd)[1:])
        assert out.zero_copy_bytes == len(big) - DIRECT_ALIGN
        out.finish()
    finally:
        out.close()
    expected = head + big[: len(big) - 7] + bytes(odd[1:])
    assert (tmp_path / "f.bin").read_bytes() == expected
    assert hasher.hexdigest() == f"{zlib.crc32(expected):08x}"


@pytest.mark.timeout(60)
def test_large_tensors_are_written_in_place_small_ones_keep_the_file_compact(
    tmp_path: Path,
) -> None:
    if not _supports_o_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    big = {f"w{i}": torch.randn((1 << 18) + i) for i in range(4)}  # ~1 MiB each, odd sizes
    small = {f"s{i}": torch.full((3,), float(i)) for i in range(2000)}
    with AsyncCheckpointer(tmp_path, keep_last=2, rank=0, world_size=1) as ckpt:
        res_big = ckpt.save(big, step=1).result(timeout=30)
        res_small = ckpt.save(small, step=2).result(timeout=30)
    # Block-aligned records, staged at page boundaries: almost every byte in place.
    tensor_bytes = sum(t.numel() * 4 for t in big.values())
    assert res_big.zero_copy_bytes >= tensor_bytes - 4 * DIRECT_ALIGN
    # 2000 tiny tensors would need up to 8 MiB of padding: records stay 64-aligned.
    assert res_small.zero_copy_bytes == 0
    assert res_small.nbytes < 2000 * 1024
    for res, state in ((res_big, big), (res_small, small)):
        loaded = torch.load(res.path, weights_only=True)
        assert loaded.keys() == state.keys()
        assert all(torch.equal(loaded[k], state[k]) for k in state)
