"""Shard sets in RAM: the pure rules (which step the ranks load from RAM, what an index
may say) and hostile heads in a real segment, which find_shards skips."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint.dcp_ram import (
    MAX_INDEX_BYTES,
    SHARD_SET_FORMAT,
    ShardFile,
    ShardSet,
    find_shards,
    index_problem,
    ram_choice,
)
from stalwart.checkpoint.ram import RamSegment

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("mine", "disk", "lowest", "highest", "expected"),
    [
        (5, 4, 5, 5, True),  # every rank holds 5, newer than disk
        (5, 5, 5, 5, True),
        (5, 6, 5, 5, False),  # disk holds a newer step
        (5, 4, 4, 5, False),  # another rank holds only 4
        (-1, 4, -1, 5, False),  # this rank holds nothing
        (-1, -1, -1, -1, False),
    ],
)
def test_ram_choice(mine: int, disk: int, lowest: int, highest: int, expected: bool) -> None:
    assert ram_choice(mine, disk, lowest, highest) is expected


def _record(
    step: int = 3, rank: int = 1, world: int = 2, tensor_bytes: int = 100
) -> rl.CommitRecord:
    return rl.CommitRecord(
        rl.FORMAT, step, rank, world, 1, 10, 0, 4096, tensor_bytes, 0, 0.0, rl.KIND_DCP
    )


def _index(**kw: object) -> ShardSet:
    base = dict(
        format=SHARD_SET_FORMAT, root="/r", step=3, rank=1, world_size=2,
        files=[ShardFile("__1_0.distcp", 0, 60)], metadata_offset=60, metadata_length=40,
    )  # fmt: skip
    base.update(kw)
    return ShardSet(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("index", "problem"),
    [
        (_index(), ""),
        (_index(format=2), "format"),
        (_index(step=4), "disagree"),
        (_index(root="/other"), "not of"),
        (_index(files=[ShardFile("__1_0.distcp", 50, 60)]), "outside"),
        (_index(files=[ShardFile("__1_0.distcp", -1, 10)]), "outside"),
        (_index(metadata_length=1 << 62), "outside"),
        (_index(files=[ShardFile("../__1_0.distcp", 0, 10)]), "not a shard file"),
        (_index(files=[ShardFile("__0_0.distcp", 0, 10)]), "not a shard file"),
        (_index(files=[ShardFile("__1_0.distcp", 0, 10)] * 2), "twice"),
    ],
)
def test_index_problem(index: ShardSet, problem: str) -> None:
    got = index_problem(index, _record(), "/r")
    assert (problem in got) if problem else got == "", got


def _segment(tmp_path: Path) -> Path:
    folder = tmp_path / "ram"
    folder.mkdir(mode=0o700)
    path = folder / rl.segment_name(0)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, rl.segment_bytes(4 << 20))
    os.close(fd)
    return path


@pytest.mark.parametrize(
    "head",
    [
        b"x" * (MAX_INDEX_BYTES + 1),  # oversized
        msgspec.json.encode({"format": "one", "files": 7}),  # wrong types
        b"\xff\xfe not json",
        msgspec.json.encode(_index(root="/elsewhere")),  # another job's root
    ],
)
def test_hostile_heads_are_skipped(tmp_path: Path, head: bytes) -> None:
    path = _segment(tmp_path)
    seg = RamSegment.open(path)
    try:
        staged, view = seg.stage_raw(head, 100, 3, 1, 2, rl.KIND_DCP)
        view.release()
        seg.commit(staged)  # committed with matching checksums: only the index is bad
    finally:
        seg.close()
    assert find_shards(path.parent, "/r", 1, 2) is None


def test_checksum_mismatch_is_skipped_and_a_good_set_found(tmp_path: Path) -> None:
    path = _segment(tmp_path)
    seg = RamSegment.open(path)
    try:
        staged, view = seg.stage_raw(msgspec.json.encode(_index()), 100, 3, 1, 2, rl.KIND_DCP)
        view.release()
        seg.commit(staged)
    finally:
        seg.close()
    held = find_shards(path.parent, "/r", 1, 2)
    assert held is not None and held.index.step == 3
    assert find_shards(path.parent, "/r", 1, 4) is None  # another world size: disk
    with open(path, "r+b") as f:
        at = rl.data_offset(held.slot, rl.slot_capacity(os.fstat(f.fileno()).st_size))
        f.seek(at + held.record.tensor_offset + 50)
        f.write(b"\x01")
    assert find_shards(path.parent, "/r", 1, 2) is None


def test_restore_from_ram_hashes_the_slot_once_and_reads_it_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The load reads the slot through the mapping find_shards verified: one hash of the
    bytes (the old path hashed them again, then copied them out before DCP read them),
    and another checkpoint folder's newer shard set in the same segment is passed over
    without a warning."""
    import torch

    from stalwart.checkpoint import dcp as sdcp
    from stalwart.checkpoint.dcp_ram import load_from_ram, snapshot_step

    path = _segment(tmp_path)
    mine, other = tmp_path / "ckpt", tmp_path / "other"
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(3)}
    seg = RamSegment.open(path)
    try:
        for root, step in ((mine, 1), (other, 2)):
            md = sdcp.save(state, root, step, ram=False)
            snapshot_step(seg, root, step, md, 0, 1)
    finally:
        seg.close()
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(path.parent))
    hashed: list[int] = []
    verify = RamSegment.verify

    def counting(self: RamSegment, slot: int, record: rl.CommitRecord) -> None:
        hashed.append(slot)
        verify(self, slot, record)

    monkeypatch.setattr(RamSegment, "verify", counting)
    into = {"w": torch.zeros(1 << 16), "b": torch.zeros(3)}
    with caplog.at_level("WARNING", logger="stalwart.checkpoint.dcp_ram"):
        assert load_from_ram(into, mine, 1) == 1
    assert torch.equal(into["w"], state["w"]) and torch.equal(into["b"], state["b"])
    assert len(hashed) == 1, hashed
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
