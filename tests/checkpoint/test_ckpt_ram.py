"""Snapshots in launcher-owned memory: segments, commit records, torn copies, restore.

Real files in a private folder made by the launcher's own class, real child processes
killed with SIGKILL in the middle of a copy.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import Custom

from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig, restore
from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint.errors import CheckpointError
from stalwart.checkpoint.ram import RamSegment, find_snapshots, load_snapshot
from stalwart.checkpoint.resume import choose_step
from stalwart.checkpoint.staging import plan
from stalwart.checkpoint.writer import SaveResult
from stalwart.config import ConfigError, parse_size
from stalwart.launch.replicas.snapshots import (
    SnapshotMemory,
    SnapshotMemoryError,
    is_stale,
    sweep_stale,
)

pytestmark = pytest.mark.timeout(120)


def _state(step: int, n: int = 64 << 10) -> dict[str, object]:
    return {
        "model": {"w": torch.full((n,), float(step)), "b": torch.arange(7) + step},
        "optim": {"state": {0: {"exp_avg": torch.full((3, 3), step, dtype=torch.bfloat16)}}},
        "step": step,
        "name": f"s{step}",
    }


def _save_steps(
    directory: Path, steps: Iterable[int], *, persist_every: int, n: int = 64 << 10
) -> list[SaveResult]:
    """Save ``_state(step)`` for each step through one checkpointer; each save's result."""
    config = CheckpointerConfig(persist_every=persist_every)
    with AsyncCheckpointer(directory, rank=0, world_size=1, config=config) as ck:
        return [ck.save(_state(s, n), s).result(timeout=60) for s in steps]


def _check(state: dict[str, object], step: int) -> None:
    model = state["model"]
    assert isinstance(model, dict)
    assert torch.equal(model["w"], torch.full_like(model["w"], float(step)))
    assert torch.equal(model["b"], torch.arange(7) + step)
    assert state["step"] == step and state["name"] == f"s{step}"


def test_launcher_segments_are_private_sized_and_freed(memory: SnapshotMemory) -> None:
    folder = memory.folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    segs = sorted(folder.glob("*.snap"))
    assert [p.name for p in segs] == [rl.segment_name(0), rl.segment_name(1)]
    for p in segs:
        st = p.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == rl.segment_bytes(8 << 20)
        # Reserved at setup: the blocks are allocated, not a sparse file.
        assert st.st_blocks * 512 >= st.st_size
    memory.close()
    assert not folder.exists()


def test_roundtrip_keeps_the_previous_snapshot(memory: SnapshotMemory) -> None:
    seg = RamSegment.open(memory.folder / rl.segment_name(0))
    try:
        for step in (1, 2, 3):
            seg.write(plan(_state(step)), step, rank=0, world_size=1)
        held = seg.records()
        assert [r.step for _, r in held] == [3, 2]  # two generations, newest first
        for slot, rec in held:
            _check(seg.read(slot, rec), rec.step)
    finally:
        seg.close()
    snaps = find_snapshots(memory.folder, rank=0, world_size=1)
    assert [s.step for s in snaps] == [3, 2]
    assert find_snapshots(memory.folder, rank=1, world_size=1) == []
    assert find_snapshots(memory.folder, rank=0, world_size=2) == []


def test_restored_tensors_do_not_alias_the_segment(memory: SnapshotMemory) -> None:
    seg = RamSegment.open(memory.folder / rl.segment_name(0))
    try:
        seg.write(plan(_state(1)), 1, rank=0, world_size=1)
        slot, rec = seg.records()[0]
        state = seg.read(slot, rec)
        # Two more saves overwrite that slot; what was restored must not change.
        seg.write(plan(_state(2)), 2, rank=0, world_size=1)
        seg.write(plan(_state(3)), 3, rank=0, world_size=1)
        _check(state, 1)
    finally:
        seg.close()


def test_a_corrupt_snapshot_is_refused_and_restore_uses_the_older_one(
    memory: SnapshotMemory, tmp_path: Path
) -> None:
    seg = RamSegment.open(memory.folder / rl.segment_name(0))
    try:
        seg.write(plan(_state(4)), 4, rank=0, world_size=1)
        seg.write(plan(_state(5)), 5, rank=0, world_size=1)
        slot, rec = seg.records()[0]
        assert rec.step == 5
    finally:
        seg.close()
    # One flipped byte in the tensor bytes of step 5 (the header still hashes right).
    path = memory.folder / rl.segment_name(0)
    at = rl.data_offset(slot, rl.slot_capacity(path.stat().st_size)) + rec.tensor_offset + 100
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    snap = find_snapshots(memory.folder, 0, 1)[0]
    with pytest.raises(CheckpointError, match="checksum"):
        load_snapshot(snap)
    found = restore(tmp_path / "ckpt", rank=0, world_size=1)
    assert found is not None and found.source == "ram" and found.step == 4
    _check(found.state_dict, 4)


def test_weights_only_refuses_custom_classes_from_ram(memory: SnapshotMemory) -> None:
    seg = RamSegment.open(memory.folder / rl.segment_name(0))
    try:
        state = {"w": torch.ones(3), "extra": Custom("x", [1, 2])}
        seg.write(plan(state), 7, rank=0, world_size=1)
        slot, rec = seg.records()[0]
        with pytest.raises(CheckpointError, match="weights_only"):
            seg.read(slot, rec)
        back = seg.read(slot, rec, weights_only=False)
        assert back["extra"] == Custom("x", [1, 2])
    finally:
        seg.close()


def test_a_segment_other_users_could_write_is_refused(memory: SnapshotMemory) -> None:
    path = memory.folder / rl.segment_name(1)
    os.chmod(path, 0o644)
    with pytest.raises(CheckpointError, match="no group/other access"):
        RamSegment.open(path)


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from stalwart.checkpoint.ram import RamSegment
    from stalwart.checkpoint.staging import plan
    seg = RamSegment.open(sys.argv[1])
    step = 0
    while True:
        step += 1
        w = torch.full((4 << 20,), float(step))
        seg.write(plan({"w": w, "step": step}), step, rank=0, world_size=1)
    """
)


def _prefix_empty(path: Path, slot: int) -> bool:
    slot_bytes = rl.slot_capacity(path.stat().st_size)
    with open(path, "rb") as f:
        f.seek(rl.header_offset(slot, slot_bytes))
        return f.read(rl.PREFIX_BYTES) == rl.EMPTY_PREFIX


def test_a_copy_torn_by_sigkill_is_never_used(tmp_path: Path) -> None:
    base = tmp_path / "shm"
    base.mkdir()
    mem = SnapshotMemory(1, 32 << 20, base=base)
    path = mem.folder / rl.segment_name(0)
    torn_seen = 0
    try:
        for _ in range(5):
            child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)])
            try:
                deadline = time.monotonic() + 60
                # Wait until it has committed a few snapshots and is copying another.
                while time.monotonic() < deadline:
                    seg = RamSegment.open(path, writable=False)
                    try:
                        newest = seg.records()
                    finally:
                        seg.close()
                    if (
                        newest
                        and newest[0][1].step >= 3
                        and any(_prefix_empty(path, s) for s in range(rl.GENERATIONS))
                    ):
                        break
                    assert child.poll() is None, "writer child died"
                else:
                    raise AssertionError("the child never got to copy a snapshot")
                child.send_signal(signal.SIGKILL)
            finally:
                child.kill()
                child.wait()
            snaps = find_snapshots(mem.folder, 0, 1)
            assert snaps, "the committed snapshot before the torn one is gone"
            torn_seen += len(snaps) < rl.GENERATIONS
            for snap in snaps:
                state = load_snapshot(snap)
                assert state["step"] == snap.step
                assert torch.equal(state["w"], torch.full((4 << 20,), float(snap.step)))
            if torn_seen >= 2:
                break
    finally:
        mem.close()
    assert torn_seen >= 1, "no kill landed inside a copy"


def test_disk_only_outside_stalwart_run_says_why_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(rl.RAM_DIR_ENV, raising=False)
    caplog.set_level(logging.INFO, logger="stalwart.checkpoint")
    results = _save_steps(tmp_path / "ck", (1, 2, 3, 4), persist_every=2, n=1024)
    why = [r for r in caplog.records if "disk only" in r.getMessage()]
    assert len(why) == 1 and rl.RAM_DIR_ENV in why[0].getMessage()
    assert [r.persisted for r in results] == [False, True, False, True]
    assert not any(r.ram_only for r in results)
    assert sorted(p.name for p in (tmp_path / "ck").glob("step_*")) == [
        "step_000000002",
        "step_000000004",
    ]


def test_ram_saves_skip_the_disk_until_persist_every(
    memory: SnapshotMemory, tmp_path: Path
) -> None:
    results = _save_steps(tmp_path / "ck", range(1, 6), persist_every=3)
    assert [r.ram_only for r in results] == [True, True, False, True, True]
    assert [p.name for p in (tmp_path / "ck").glob("step_*")] == ["step_000000003"]
    found = restore(tmp_path / "ck", rank=0, world_size=1)
    assert found is not None and (found.step, found.source) == (5, "ram")
    _check(found.state_dict, 5)


def test_a_snapshot_too_large_for_the_slot_goes_to_disk(
    memory: SnapshotMemory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with AsyncCheckpointer(
        tmp_path / "ck", rank=0, world_size=1, config=CheckpointerConfig(persist_every=100)
    ) as ck:
        big = {"w": torch.zeros(3 << 20)}  # 12 MiB > the 8 MiB slot
        res = ck.save(big, 1).result(timeout=60)
    assert res.persisted and not res.ram_only
    assert any("does not fit" in r.getMessage() for r in caplog.records)


def test_no_room_is_a_one_line_error_at_setup(small_tmpfs: Path) -> None:
    with pytest.raises(SnapshotMemoryError) as err:
        SnapshotMemory(2, 4 << 20, base=small_tmpfs)
    msg = str(err.value)
    assert "\n" not in msg and "--ckpt-ram 4.0 MiB" in msg and str(small_tmpfs) in msg
    assert list(small_tmpfs.iterdir()) == []  # nothing half-made


@pytest.mark.parametrize(
    ("wanted", "free", "avail", "problem"),
    [
        (1 << 30, 2 << 30, 4 << 30, None),
        (3 << 30, 2 << 30, 4 << 30, "free"),
        (3 << 30, 8 << 30, 2 << 30, "available"),
    ],
)
def test_room_error(wanted: int, free: int, avail: int, problem: str | None) -> None:
    msg = rl.room_error(wanted, free, avail, "/dev/shm")
    assert (msg is None) if problem is None else (msg is not None and problem in msg)


@pytest.mark.parametrize(
    ("owner", "age", "alive", "stale"),
    [
        (None, 5.0, None, False),  # being set up right now
        (None, 600.0, None, True),
        ((123, 10.0), 0.0, None, True),  # launcher gone
        ((123, 10.0), 0.0, 10.0, False),  # launcher alive
        ((123, 10.0), 0.0, 99.0, True),  # pid reused by another process
    ],
)
def test_is_stale(
    owner: tuple[int, float] | None, age: float, alive: float | None, stale: bool
) -> None:
    assert is_stale(owner, age, lambda pid: alive) is stale


def test_the_next_launcher_removes_folders_of_a_dead_one(tmp_path: Path) -> None:
    base = tmp_path / "shm"
    base.mkdir()
    dead = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pathlib import Path; import sys\n"
            "from stalwart.launch.replicas.snapshots import SnapshotMemory\n"
            "m = SnapshotMemory(1, 1 << 20, base=Path(sys.argv[1]))\n"
            "print(m.folder)",  # exits without close(), like a SIGKILLed launcher
            str(base),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    left = Path(dead.stdout.strip())
    assert left.is_dir()
    live = SnapshotMemory(1, 1 << 20, base=base)
    try:
        assert not left.exists()
        assert sweep_stale(base) == []  # a live launcher's folder stays
        assert live.folder.is_dir()
    finally:
        live.close()


@pytest.mark.parametrize(
    ("per_rank", "step"),
    [
        ([[5, 4, 3]], 5),
        ([[5, 4, 3], [5, 4, 3]], 5),
        ([[5, 4, 3], [4, 3]], 4),  # rank 1's step 5 is corrupt
        ([[9, 5], [9, 4], [9, 5]], 9),
        ([[6, 5], [5, 4], [6, 4]], None),
        ([[3], []], None),
        ([], None),
    ],
)
def test_choose_step(per_rank: list[list[int]], step: int | None) -> None:
    assert choose_step(per_rank) == step


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("0", 0),
        ("4096", 4096),
        (4096, 4096),
        ("512MiB", 512 << 20),
        ("2G", 2 << 30),
        ("1.5GiB", 3 << 29),
        ("2 gb", 2 * 1000**3),
        ("10k", 10 << 10),
    ],
)
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text, "--ckpt-ram") == size


@pytest.mark.parametrize("text", ["lots", "-1GiB", "2XB", "", "nan", "GiB"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^--ckpt-ram .*expected a size"):
        parse_size(text, "--ckpt-ram")


def test_when_the_snapshot_memory_is_gone_restore_reads_the_disk(
    memory: SnapshotMemory, tmp_path: Path
) -> None:
    results = _save_steps(tmp_path / "ck", (1, 2, 3), persist_every=2)
    assert [r.persisted for r in results] == [False, True, False]
    found = restore(tmp_path / "ck", rank=0, world_size=1)
    assert found is not None and (found.step, found.source) == (3, "ram")
    memory.close()  # what the guardian does after a launcher SIGKILL
    found = restore(tmp_path / "ck", rank=0, world_size=1)
    assert found is not None and (found.step, found.source) == (2, "disk")
    _check(found.state_dict, 2)


def test_back_to_back_ram_saves_commit_in_order(
    memory: SnapshotMemory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The checksum and commit of one snapshot run on a thread while the caller goes on;
    # the next snapshot must not pick its slot before that commit. A slow commit (as on
    # a busy host) makes the race certain.
    real_commit = RamSegment.commit

    def slow_commit(self: RamSegment, staged: Any) -> Any:
        time.sleep(0.1)
        return real_commit(self, staged)

    monkeypatch.setattr(RamSegment, "commit", slow_commit)
    with AsyncCheckpointer(
        tmp_path / "ck", rank=0, world_size=1, config=CheckpointerConfig(persist_every=100)
    ) as ck:
        futures = [ck.save(_state(s), s) for s in range(1, 8)]
        ck.wait()
        assert [f.result().step for f in futures] == list(range(1, 8))
        assert all(f.result().ram_only for f in futures)
    snaps = find_snapshots(memory.folder, 0, 1)
    assert [s.step for s in snaps] == [7, 6]
    for snap in snaps:
        _check(load_snapshot(snap), snap.step)
