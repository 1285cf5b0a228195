"""Shard sets in RAM: the pure rules (which step the ranks load from RAM and who serves
which files, what an offer and an index may say) and hostile heads in a real segment,
which find_all_shards skips."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint.dcp_ram import (
    MAX_HELD,
    MAX_INDEX_BYTES,
    MAX_OFFER_BYTES,
    OFFER_FORMAT,
    SHARD_SET_FORMAT,
    HeldSet,
    RamOffer,
    RamPlan,
    ShardFile,
    ShardSet,
    find_all_shards,
    index_problem,
    plan_ram_load,
    read_offer,
)
from stalwart.checkpoint.errors import CheckpointCorruptError
from stalwart.checkpoint.ram import RamSegment

pytestmark = pytest.mark.timeout(60)


def _offer(
    rank: int, disk: int, *held: tuple[int, int, int] | tuple[int, int, int, str]
) -> RamOffer:
    """``held``: (step, saving world size, saving rank[, save token]) of each shard set."""
    return RamOffer(OFFER_FORMAT, rank, disk, [HeldSet(*h) for h in held])


@pytest.mark.parametrize(
    ("offers", "plan"),
    [
        # The same world, each rank its own set: nothing crosses the group.
        ([_offer(0, 4, (5, 2, 0)), _offer(1, 4, (5, 2, 1))], RamPlan(5, 2, (0, 1))),
        ([_offer(0, 5, (5, 2, 0)), _offer(1, 5, (5, 2, 1))], RamPlan(5, 2, (0, 1))),
        # Shrink 2 -> 1: the one rank's node holds both saving ranks' sets.
        ([_offer(0, 3, (3, 2, 0), (3, 2, 1))], RamPlan(3, 2, (0, 0))),
        # Shrink 4 -> 2: rank 1's node holds 1..3 (its own and replicas); 2 and 3 go to
        # the least loaded holder.
        (
            [_offer(0, 7, (7, 4, 0), (7, 4, 2)), _offer(1, 7, (7, 4, 1), (7, 4, 2), (7, 4, 3))],
            RamPlan(7, 4, (0, 1, 0, 1)),
        ),
        # Grow 1 -> 2: the new rank holds nothing, rank 0 serves the one set.
        ([_offer(0, 3, (3, 1, 0)), _offer(1, 3)], RamPlan(3, 1, (0,))),
        # The newest step is not whole (rank 1's set is gone), the older one is, but disk
        # holds the newest: disk.
        ([_offer(0, 6, (6, 2, 0), (5, 2, 0)), _offer(1, 6, (5, 2, 1))], None),
        # ... and when disk is no newer than the older whole step, that step from RAM.
        ([_offer(0, 5, (6, 2, 0), (5, 2, 0)), _offer(1, 5, (5, 2, 1))], RamPlan(5, 2, (0, 1))),
        # Disk holds a newer step.
        ([_offer(0, 6, (5, 2, 0)), _offer(1, 6, (5, 2, 1))], None),
        # Only one rank sees the newer step on disk: the newest every rank sees is 4.
        ([_offer(0, 4, (5, 2, 0)), _offer(1, 6, (5, 2, 1))], RamPlan(5, 2, (0, 1))),
        # Sets of one save go together; another save of the step (or one the coordinator
        # never committed) is not mixed in.
        ([_offer(0, 5, (5, 2, 0, "a")), _offer(1, 5, (5, 2, 1, "b"))], None),
        (
            [_offer(0, 5, (5, 2, 0, "a")), _offer(1, 5, (5, 2, 1, "b"), (5, 2, 1, "a"))],
            RamPlan(5, 2, (0, 1), "a"),
        ),
        # Sets of the same step from different world sizes never mix.
        ([_offer(0, 3, (3, 2, 0)), _offer(1, 3, (3, 4, 1))], None),
        ([_offer(0, -1), _offer(1, -1)], None),
        ([_offer(0, 2, (3, 2, 0), (3, 2, 1)), None], None),  # rank 1's offer refused
        ([], None),
    ],
)
def test_plan_ram_load(offers: list[RamOffer | None], plan: RamPlan | None) -> None:
    got, why = plan_ram_load(offers)
    assert got == plan, why
    assert (why == "") is (plan is not None)


def _raw(**kw: object) -> bytes:
    base: dict[str, object] = dict(
        format=OFFER_FORMAT, rank=1, newest_on_disk=4,
        held=[{"step": 5, "world_size": 2, "rank": 1}],
    )  # fmt: skip
    base.update(kw)
    return msgspec.json.encode(base)


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (_raw(), ""),
        (b"x" * (MAX_OFFER_BYTES + 1), "at most"),  # oversized
        (b"\xff not json", "offer"),
        (_raw(held="all"), "offer"),  # wrong type
        (_raw(secret=1), "offer"),  # a field no offer has
        (_raw(format=2), "format"),
        (_raw(rank=0), "says it is rank 0"),  # another rank's (or a stranger's) record
        (_raw(newest_on_disk=-5), "on disk"),
        (_raw(held=[{"step": 5, "world_size": 2, "rank": 2}]), "expected step"),
        (_raw(held=[{"step": 5, "world_size": 2, "rank": -1}]), "expected step"),
        (_raw(held=[{"step": -1, "world_size": 2, "rank": 0}]), "expected step"),
        (_raw(held=[{"step": 5, "world_size": 1 << 40, "rank": 0}]), "expected step"),
        (_raw(held=[{"step": 5, "world_size": 2, "rank": 1}] * 2), "twice"),
        (_raw(held=[{"step": 5, "world_size": 2, "rank": 1, "save": "f" * 65}]), "save token"),
        (
            _raw(held=[{"step": s, "world_size": 1, "rank": 0} for s in range(MAX_HELD + 1)]),
            "at most",
        ),
    ],
)
def test_read_offer(raw: bytes, problem: str) -> None:
    if not problem:
        assert read_offer(raw, 1, 2) == RamOffer(OFFER_FORMAT, 1, 4, [HeldSet(5, 2, 1)])
        return
    with pytest.raises(CheckpointCorruptError, match=problem):
        read_offer(raw, 1, 2)


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
        (_index(save="f" * 65), "save token"),
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
    assert find_all_shards(path.parent, "/r") == []


def test_checksum_mismatch_is_found_by_verify(tmp_path: Path) -> None:
    """find_all_shards reads heads only; the data's checksum is the server's to check,
    the first time this process reads the slot under its record."""
    path = _segment(tmp_path)
    seg = RamSegment.open(path)
    try:
        staged, view = seg.stage_raw(msgspec.json.encode(_index()), 100, 3, 1, 2, rl.KIND_DCP)
        view.release()
        seg.commit(staged)
    finally:
        seg.close()
    (held,) = find_all_shards(path.parent, "/r")
    assert (held.index.step, held.index.rank, held.index.world_size) == (3, 1, 2)
    with open(path, "r+b") as f:
        at = rl.data_offset(held.slot, rl.slot_capacity(os.fstat(f.fileno()).st_size))
        f.seek(at + held.record.tensor_offset + 50)
        f.write(b"\x01")
    (held,) = find_all_shards(path.parent, "/r")
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        held.verify()


def test_restore_from_ram_hashes_the_slot_once_and_reads_it_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The load reads the slot through the mapping find_all_shards verified: one hash of the
    bytes (an older path hashed them again, then copied them out before DCP read them),
    and another checkpoint folder's newer shard set in the same segment is passed over
    without a warning."""
    import torch

    from stalwart.checkpoint import dcp as sdcp
    from stalwart.checkpoint.dcp_ram import load_from_ram

    path = _segment(tmp_path)
    mine, other = tmp_path / "ckpt", tmp_path / "other"
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(3)}
    seg = RamSegment.open(path)
    try:
        for root, step in ((mine, 1), (other, 2)):
            sdcp.save(state, root, step, ram=seg)
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


def _two_steps(tmp_path: Path, state: dict[str, object]) -> tuple[Path, Path]:
    """Steps 1 and 2 of one root in RAM, in two segments of the node; the root."""
    from stalwart.checkpoint import dcp as sdcp

    path = _segment(tmp_path)
    second = path.parent / rl.segment_name(1)
    second.write_bytes(b"")
    os.truncate(second, path.stat().st_size)
    second.chmod(0o600)
    root = tmp_path / "ckpt"
    for step, where in ((1, second), (2, path)):
        seg = RamSegment.open(where)
        try:
            sdcp.save(state, root, step, ram=seg, keep_last=None)  # type: ignore[arg-type]
        finally:
            seg.close()
    return path, root


def test_restore_from_ram_hashes_only_what_it_serves_and_copies_each_item_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the served shard set is hashed (the node's older set of the same root is not:
    the loader before hashed every set on the node), and each tensor item goes straight
    from the slot into its destination: no torch.load materialises it (DCP's reader
    loads every item into fresh memory, then copies it again). A destination of another
    dtype still loads, DCP's way."""
    import torch
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from stalwart.checkpoint import dcp_ram
    from stalwart.checkpoint.dcp_ram import load_from_ram

    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(3)}
    path, root = _two_steps(tmp_path, state)
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(path.parent))
    hashed: list[int] = []
    verify = RamSegment.verify

    def counting(self: RamSegment, slot: int, record: rl.CommitRecord) -> None:
        hashed.append(record.step)
        verify(self, slot, record)

    materialised: list[object] = []
    real_load = torch.load

    def load(*args: object, **kw: object) -> object:
        if kw.get("map_location") != "meta":
            materialised.append(kw.get("map_location"))
        return real_load(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(RamSegment, "verify", counting)
    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(dcp_fs.torch, "load", load)
    into = {"w": torch.zeros(1 << 16), "b": torch.zeros(3)}
    assert load_from_ram(into, root, 2) == 2
    assert torch.equal(into["w"], state["w"]) and torch.equal(into["b"], state["b"])
    assert hashed == [2]
    assert materialised == []
    converted = {"w": torch.zeros(1 << 16, dtype=torch.float64), "b": torch.zeros(3)}
    assert load_from_ram(converted, root, 2) == 2
    assert torch.equal(converted["w"], state["w"].double())
    assert len(materialised) == 1  # the converted item only
    assert dcp_ram.MAX_ROUNDS >= 2


def test_a_served_set_that_does_not_verify_is_dropped_and_an_older_one_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newest set in RAM is torn: its server finds out when it hashes it, and the
    ranks plan again without it (the older whole step; disk holds nothing newer)."""
    import torch

    from stalwart.checkpoint.dcp_ram import load_from_ram

    state = {"w": torch.arange(1 << 12, dtype=torch.float32)}
    path, root = _two_steps(tmp_path, state)
    (newest,) = [h for h in find_all_shards(path.parent, str(root)) if h.index.step == 2]
    with open(path, "r+b") as f:
        at = rl.data_offset(newest.slot, rl.slot_capacity(os.fstat(f.fileno()).st_size))
        f.seek(at + newest.record.tensor_offset + 7)
        f.write(b"\xff")
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(path.parent))
    into = {"w": torch.zeros(1 << 12)}
    assert load_from_ram(into, root, 1) == 1


def test_ram_keeps_the_metadata_as_written_when_torch_does_not_fill_the_callers_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.11's ``FileSystemWriter.finish`` (seen on a lent GPU machine) writes the
    storage table into the file but not into the Metadata object DCP hands the writer;
    the RAM copy must be the metadata as written, or no restore from RAM can use it."""
    import copy

    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from stalwart.checkpoint import dcp as sdcp
    from stalwart.checkpoint.dcp_ram import load_from_ram

    finish = FileSystemWriter.finish

    def on_a_copy(self: FileSystemWriter, metadata: Any, results: Any) -> None:
        finish(self, copy.deepcopy(metadata), results)

    monkeypatch.setattr(FileSystemWriter, "finish", on_a_copy)
    path = _segment(tmp_path)
    state = {"w": torch.arange(1 << 12, dtype=torch.float32)}
    seg = RamSegment.open(path)
    try:
        sdcp.save(state, tmp_path / "ckpt", 1, ram=seg)
    finally:
        seg.close()
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(path.parent))
    into = {"w": torch.zeros(1 << 12)}
    assert load_from_ram(into, tmp_path / "ckpt", 1) == 1
    assert torch.equal(into["w"], state["w"])
