"""A snapshot's tensor bytes are hashed once per mapping, off the restore where possible
(issue 24 item 4): an in-process restart reads back what its own checkpointer committed
without hashing 2 x 512 MiB again, and a restarted worker's checkpointer hashes its newest
snapshot on a thread while the program sets up its process group. Neither may let a
changed or lying slot through.

Real segments made by the launcher's own class; the hashing is observed through a
counting wrapper around the ``xxhash`` module the segment code uses.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import xxhash

from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig
from stalwart.checkpoint import ram as ram_module
from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint.ram import RamSegment
from stalwart.checkpoint.staging import plan
from stalwart.launch.replicas.snapshots import SnapshotMemory

pytestmark = pytest.mark.timeout(120)
N = 1 << 18  # elements: 1 MiB of float32 in "a", 0.5 MiB in "b"
CONFIG = CheckpointerConfig(persist_every=10**6, auto_reserve=False)


def _state(v: float) -> dict[str, Any]:
    return {"a": torch.full((N,), v), "b": torch.full((N // 2,), -v), "step": int(v)}


@dataclass
class _Counted:
    """Bytes hashed through ``xxhash``, by the name of the thread that hashed them."""

    by_thread: dict[str, int] = field(default_factory=dict)

    def add(self, data: Any) -> None:
        name = threading.current_thread().name
        self.by_thread[name] = self.by_thread.get(name, 0) + memoryview(data).nbytes

    def total(self) -> int:
        return sum(self.by_thread.values())


class _CountingXxhash:
    def __init__(self, counted: _Counted) -> None:
        self._counted = counted

    def xxh3_64_intdigest(self, data: Any) -> int:
        self._counted.add(data)
        return xxhash.xxh3_64_intdigest(data)

    def xxh3_64(self) -> Any:
        counted, inner = self._counted, xxhash.xxh3_64()

        class Hasher:
            def update(self, data: Any) -> None:
                counted.add(data)
                inner.update(data)

            def intdigest(self) -> int:
                return inner.intdigest()

        return Hasher()


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Counted]:
    counted = _Counted()
    monkeypatch.setattr(ram_module, "xxhash", _CountingXxhash(counted))
    yield counted


def _flip(path: Path, slot: int, rec: rl.CommitRecord) -> None:
    """One flipped byte in a slot's tensor bytes, written past the protocol (its header
    still hashes right)."""
    at = rl.data_offset(slot, rl.slot_capacity(path.stat().st_size)) + rec.tensor_offset + 4096
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_an_inprocess_restore_of_its_own_commit_does_not_hash_the_tensors_again(
    memory: SnapshotMemory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1, config=CONFIG) as ck:
        ck.save(_state(3.0), 3).result(timeout=60)
        counted = _Counted()
        monkeypatch.setattr(ram_module, "xxhash", _CountingXxhash(counted))
        into = _state(0.0)
        ptr = into["a"].data_ptr()
        found = ck.restore(into=into)
        assert found is not None and (found.step, found.source) == (3, "ram")
        assert into["a"].data_ptr() == ptr
        assert torch.equal(into["a"], _state(3.0)["a"]) and torch.equal(
            into["b"], -into["a"][: N // 2]
        )
        # Only the skeleton and headers (a few KiB) are hashed, not the 1.5 MiB of tensors.
        assert counted.total() < N, counted.by_thread


def test_a_restarted_checkpointer_hashes_the_snapshot_off_the_restoring_thread(
    memory: SnapshotMemory, tmp_path: Path, hashed: _Counted
) -> None:
    seg = RamSegment.open(memory.folder / rl.segment_name(0))
    seg.write(plan(_state(5.0)), 5, rank=0, world_size=1)
    seg.close()
    hashed.by_thread.clear()
    with AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1, config=CONFIG) as ck:
        into = _state(0.0)
        found = ck.restore(into=into)
        assert found is not None and found.step == 5
        assert torch.equal(into["a"], _state(5.0)["a"])
    tensor_bytes = 6 * N
    assert hashed.by_thread.get("stalwart-ram-verify", 0) >= tensor_bytes, hashed.by_thread
    assert hashed.by_thread.get("MainThread", 0) < N, hashed.by_thread


def test_a_snapshot_changed_past_the_protocol_before_the_restart_is_refused(
    memory: SnapshotMemory, tmp_path: Path
) -> None:
    path = memory.folder / rl.segment_name(0)
    seg = RamSegment.open(path)
    seg.write(plan(_state(4.0)), 4, rank=0, world_size=1)
    seg.write(plan(_state(5.0)), 5, rank=0, world_size=1)
    slot, rec = seg.records()[0]
    seg.close()
    _flip(path, slot, rec)
    # The restarted worker's background check finds it torn; the restore refuses it and
    # agrees on step 4; the caller's tensors never see step 5's bytes.
    with AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1, config=CONFIG) as ck:
        into = _state(0.0)
        found = ck.restore(into=into)
        assert found is not None and found.step == 4
        assert torch.equal(into["a"], _state(4.0)["a"])


def test_a_slot_rewritten_by_another_writer_is_hashed_again(
    memory: SnapshotMemory, tmp_path: Path
) -> None:
    path = memory.folder / rl.segment_name(0)
    with AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1, config=CONFIG) as ck:
        ck.save(_state(1.0), 1).result(timeout=60)
        ck.save(_state(2.0), 2).result(timeout=60)
        # Another writer (the launcher filling in a fetched snapshot would do the same)
        # reuses the slot of step 1 through the protocol, then its bytes are damaged.
        other = RamSegment.open(path)
        other.write(plan(_state(7.0)), 7, rank=0, world_size=1)
        slot, rec = other.records()[0]
        other.close()
        assert rec.step == 7
        _flip(path, slot, rec)
        into = _state(0.0)
        found = ck.restore(into=into)
        # Step 7's record is not the one this checkpointer committed there: hashed, torn,
        # refused; step 2 (its own, unchanged) is restored.
        assert found is not None and found.step == 2
        assert torch.equal(into["a"], _state(2.0)["a"])


def test_a_record_lying_about_its_bounds_fails_no_thread_and_is_skipped(
    memory: SnapshotMemory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = memory.folder / rl.segment_name(0)
    seg = RamSegment.open(path)
    seg.write(plan(_state(5.0)), 5, rank=0, world_size=1)
    slot, rec = seg.records()[0]
    seg.close()

    # A header that hashes right but claims more tensor bytes than the whole segment.
    lying = msgspec.structs.replace(rec, tensor_bytes=1 << 40)
    head = rl.encode_header(lying)
    with open(path, "r+b") as f:
        f.seek(rl.header_offset(slot, rl.slot_capacity(path.stat().st_size)))
        f.write(head)
    failures: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    with AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1, config=CONFIG) as ck:
        assert ck._ram is not None
        into = _state(0.0)
        assert ck.restore(into=into) is None
        assert torch.equal(into["a"], _state(0.0)["a"])
    assert not failures
