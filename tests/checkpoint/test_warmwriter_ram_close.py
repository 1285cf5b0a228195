"""``AsyncCheckpointer.close()`` right after a restore from RAM does not wait for the
segment's background pre-faulting (issue 24 item 2): a restarted worker whose job ends
soon after its restore used to sit in close() for seconds (2.0-2.5 s measured with a
1 GiB segment, 19 s on a loaded machine)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stalwart.checkpoint import AsyncCheckpointer
from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint.ram import RamSegment
from stalwart.checkpoint.staging import plan
from stalwart.launch.replicas.snapshots import SnapshotMemory, default_base

pytestmark = pytest.mark.timeout(120)
SLOT = 256 << 20


@pytest.fixture
def big_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[SnapshotMemory]:
    """The launcher's snapshot memory for one rank, in shared memory as the launcher
    makes it, with slots large enough that pre-faulting them takes a while."""
    base = Path(tempfile.mkdtemp(dir=default_base(), prefix="ww-ramclose-"))
    mem = SnapshotMemory(1, SLOT, base=base)
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(mem.folder))
    monkeypatch.setenv("LOCAL_RANK", "0")
    try:
        yield mem
    finally:
        mem.close()
        shutil.rmtree(base, ignore_errors=True)


def _full_populate_s(path: Path) -> float:
    """How long pre-faulting the whole segment takes here and now (a fresh mapping)."""
    seg = RamSegment.open(path)
    t0 = time.monotonic()
    seg.start_populating()
    seg.wait_populated()
    took = time.monotonic() - t0
    seg.close()
    return took


def test_close_after_a_ram_restore_does_not_wait_for_prefaulting(
    tmp_path: Path, big_memory: SnapshotMemory
) -> None:
    state = {"w": torch.arange(256 * 1024, dtype=torch.float32), "step": 3}
    with AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1) as first:
        assert first.save(state, step=3) is not None
        first.wait()
    # A restarted worker: maps the segment afresh, restores, and its job ends at once.
    again = AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1)
    found = again.restore()
    assert found is not None and found.step == 3
    assert torch.equal(found.state_dict["w"], state["w"])
    t0 = time.monotonic()
    again.close()
    close_s = time.monotonic() - t0
    full_s = _full_populate_s(big_memory.folder / rl.segment_name(0))
    # Relative to the full pre-fault measured on the same machine right after, so the
    # machine's load cancels out; the absolute goal (<= 0.2 s) is bench_ram.py's.
    assert close_s < max(0.25 * full_s, 0.2), (close_s, full_s)


def test_close_of_a_restarted_checkpointer_does_not_wait_for_its_background_hash(
    tmp_path: Path, big_memory: SnapshotMemory
) -> None:
    # 192 MiB in the 256 MiB slot: hashing it takes long enough to tell waiting for all
    # of it from stopping between chunks.
    seg = RamSegment.open(big_memory.folder / rl.segment_name(0))
    seg.write(plan({"w": torch.ones(48 << 20), "step": 1}), 1, rank=0, world_size=1)
    slot, rec = seg.records()[0]
    seg.close()
    seg = RamSegment.open(big_memory.folder / rl.segment_name(0), writable=False)
    t0 = time.monotonic()
    seg.verify(slot, rec)  # what the background check does, timed here and now
    full_s = time.monotonic() - t0
    seg.close()
    # A restarted worker whose job ends before it restores: its checkpointer's check of
    # the newest snapshot has just begun.
    again = AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1)
    assert again._ram is not None and again._ram._prechecking is not None
    t0 = time.monotonic()
    again.close()
    close_s = time.monotonic() - t0
    assert close_s < max(0.5 * full_s, 0.05), (close_s, full_s)
