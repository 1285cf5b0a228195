"""Plain ``dcp.save(storage_writer=DcpWriter(...))`` / ``dcp.load(storage_reader=
DcpReader(...))`` with a ``--ckpt-ram`` segment, in one process: the load reads RAM, and
falls back to disk whenever what RAM holds is not the folder's committed save, whole."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from stalwart import runlog
from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint.dcp import unwrap
from stalwart.checkpoint.dcp_ram import MAX_INDEX_BYTES
from stalwart.checkpoint.dcp_ramsource import RamVote, agreed
from stalwart.checkpoint.dcp_records import DcpCommit
from stalwart.checkpoint.dcp_storage import DcpReader, DcpWriter, read_record
from stalwart.checkpoint.errors import CheckpointCorruptError
from stalwart.checkpoint.layout import step_dir
from stalwart.checkpoint.ram import RamSegment

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


@pytest.mark.parametrize(
    ("votes", "use"),
    [
        ([RamVote(True), RamVote(True)], True),
        ([RamVote(True), RamVote(False)], False),
        ([RamVote(True), None], False),  # a rank whose reader takes no part
        ([RamVote(True), {"ok": True}], False),  # not a vote
        ([], False),
    ],
)
def test_every_rank_reads_ram_only_when_every_rank_can(votes: list[object], use: bool) -> None:
    assert agreed(votes) is use


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1 << 14, dtype=torch.float32) + value, "b": torch.ones(5) * value}


@pytest.fixture
def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    """Step 1 of ``ckpt`` saved through plain ``dcp.save`` with a RAM segment; returns the
    step folder, the segment and the events file."""
    ram = tmp_path / "ram"
    ram.mkdir(mode=0o700)
    seg_path = ram / rl.segment_name(0)
    fd = os.open(seg_path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, rl.segment_bytes(4 << 20))
    os.close(fd)
    seg = RamSegment.open(seg_path)
    try:
        dcp.save(_state(1.0), storage_writer=DcpWriter(tmp_path / "ckpt", 1, ram=seg))
    finally:
        seg.close()
    events = tmp_path / "events.jsonl"
    events.touch()
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(ram))
    monkeypatch.setenv(runlog.EVENTS_FILE_ENV, str(events))
    return step_dir(tmp_path / "ckpt", 1), seg_path, events


def _load(folder: Path, events: Path) -> str:
    into = {"w": torch.zeros(1 << 14), "b": torch.zeros(5)}
    dcp.load(into, storage_reader=DcpReader(folder))
    want = _state(1.0)
    assert all(torch.equal(into[k], want[k]) for k in want), into
    (restored,) = [
        e
        for e in map(json.loads, events.read_text().splitlines())
        if e["event"] == "checkpoint_restored"
    ]
    events.write_text("")
    assert restored["step"] == 1
    return str(restored["source"])


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def _slot(seg_path: Path) -> tuple[int, rl.CommitRecord]:
    seg = RamSegment.open(seg_path, writable=False)
    try:
        ((slot, rec),) = seg.records()
    finally:
        seg.close()
    return slot, rec


def test_the_shards_come_from_ram_while_the_files_are_torn(saved: tuple[Path, Path, Path]) -> None:
    folder, _, events = saved
    commit = read_record(folder / "stalwart.commit.json", DcpCommit)
    assert len(commit.save) == 16  # the save's token, shared with its RAM copy
    shard = folder / "__0_0.distcp"
    _flip(shard, shard.stat().st_size // 2)
    assert _load(folder, events) == "ram"
    # Without the RAM copy the same load fails its checksum: RAM was what it read.
    with pytest.raises(CheckpointException) as info:
        dcp.load(_state(0.0), storage_reader=DcpReader(folder, ram=False))
    assert "commit record says" in str(unwrap(info.value))


def _forge(seg_path: Path, head: bytes, body: bytes) -> None:
    """A committed slot (checksums that match) holding ``head`` and ``body``."""
    seg = RamSegment.open(seg_path)
    try:
        staged, view = seg.stage_raw(head, len(body), 1, 0, 1, rl.KIND_DCP)
        with view:
            view[:] = body
        seg.commit(staged)
    finally:
        seg.close()


def _index(seg_path: Path) -> dict[str, object]:
    seg = RamSegment.open(seg_path, writable=False)
    try:
        ((slot, rec),) = seg.records()
        out: dict[str, object] = msgspec.json.decode(seg.head(slot, rec, MAX_INDEX_BYTES))
        body = bytes(seg.body(slot, rec))
    finally:
        seg.close()
    out["_body"] = body
    return out


@pytest.mark.parametrize(
    "damage",
    [
        "flipped byte in the slot",
        "another save's shards",
        "oversized index",
        "index with hostile extents",
        "overlong save token",
        "commit record of another save",
    ],
)
def test_ram_that_is_not_the_committed_save_whole_is_passed_over_for_disk(
    saved: tuple[Path, Path, Path], damage: str
) -> None:
    folder, seg_path, events = saved
    index = _index(seg_path)
    body = index.pop("_body")
    assert isinstance(body, bytes)
    if damage == "flipped byte in the slot":
        slot, rec = _slot(seg_path)
        at = rl.data_offset(slot, rl.slot_capacity(seg_path.stat().st_size))
        _flip(seg_path, at + rec.tensor_offset + rec.tensor_bytes // 2)
    else:
        # The genuine slot is replaced by a forged one that checks out (the segment has
        # two slots: fill both).
        if damage == "another save's shards":
            index["save"] = "0" * 16
            body = bytes(len(body))
        elif damage == "oversized index":
            index["pad"] = "x" * (MAX_INDEX_BYTES + 1)
        elif damage == "index with hostile extents":
            index["files"] = [{"name": "__0_0.distcp", "offset": 1 << 62, "length": 1 << 62}]
        elif damage == "overlong save token":
            index["save"] = "f" * 100
        if damage == "commit record of another save":
            record = read_record(folder / "stalwart.commit.json", DcpCommit)
            forged = msgspec.structs.replace(record, save="1" * 16)
            (folder / "stalwart.commit.json").write_bytes(msgspec.json.encode(forged))
        else:
            for _ in range(2):
                _forge(seg_path, msgspec.json.encode(index), body)
    assert _load(folder, events) == "disk"


def test_a_hostile_commit_record_is_one_clear_error(saved: tuple[Path, Path, Path]) -> None:
    folder, _, events = saved
    (folder / "stalwart.commit.json").write_bytes(b'{"format": 1, "save": ' + b"[" * 100_000)
    with pytest.raises(CheckpointException) as info:
        dcp.load(_state(0.0), storage_reader=DcpReader(folder))
    err = unwrap(info.value)
    assert isinstance(err, CheckpointCorruptError) and "unreadable record" in str(err), err
    assert events.read_text() == ""


def test_ram_items_go_straight_into_their_destination(
    saved: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DcpReader's RAM path copies each tensor item from the verified slot into the tensor
    DCP hands over: no torch.load materialises it first (DCP's reader, which the RAM path
    went through before, loads every item into fresh memory and copies it again). A
    destination of another dtype still loads, by DCP's way, for that item only (torch.load
    on the meta device to find it, then the materialising load)."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    folder, _, events = saved
    materialised: list[object] = []
    real_load = torch.load

    def load(*args: object, **kw: object) -> object:
        materialised.append(kw.get("map_location"))
        return real_load(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(dcp_fs.torch, "load", load)
    assert _load(folder, events) == "ram"
    # Not even on the meta device: the item's small pickle is read by read_layout.
    assert materialised == []
    into = {"w": torch.zeros(1 << 14, dtype=torch.float64), "b": torch.zeros(5)}
    dcp.load(into, storage_reader=DcpReader(folder))
    assert torch.equal(into["w"], _state(1.0)["w"].double())
    assert sorted(map(str, materialised)) == ["cpu"], materialised
