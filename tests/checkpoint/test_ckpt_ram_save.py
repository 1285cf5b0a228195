"""The save path into the launcher's memory: background staging, its guards, copy threads,
pre-faulting the segment.

Real segments made by the launcher's own class, a real model and optimizer; the copy
thread is held on an event so the order of events is certain, not a guess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.checkpoint import (
    AsyncCheckpointer,
    CheckpointerConfig,
    StagingConflictError,
    StagingMode,
)
from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint.ram import RamSegment, find_snapshots, load_snapshot
from stalwart.checkpoint.staging import _copy_pool, _run_copies, plan
from stalwart.launch.replicas.snapshots import SnapshotMemory

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def held_stage(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """RamSegment.stage waits for the returned event (set it to let copies run)."""
    release = threading.Event()
    real = RamSegment.stage

    def stage(self: RamSegment, *args: Any, **kwargs: Any) -> Any:
        assert release.wait(60), "the test never released the copy"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(RamSegment, "stage", stage)
    return release


def _background(**kw: Any) -> CheckpointerConfig:
    return CheckpointerConfig(staging=StagingMode.BACKGROUND, persist_every=1000, **kw)


def test_background_ram_save_returns_before_the_copy(
    memory: SnapshotMemory, tmp_path: Path, held_stage: threading.Event
) -> None:
    w = torch.full((1 << 16,), 1.0)
    with AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1, config=_background()) as ck:
        fut = ck.save({"w": w}, 1)  # returns although the copy cannot start yet
        assert not fut.done()
        assert find_snapshots(memory.folder, 0, 1) == []
        held_stage.set()
        assert fut.result(timeout=60).ram_only
    snaps = find_snapshots(memory.folder, 0, 1)
    assert [s.step for s in snaps] == [1]
    assert torch.equal(load_snapshot(snaps[0])["w"], w)


def test_a_tensor_changed_during_a_background_ram_copy_fails_that_save(
    memory: SnapshotMemory, tmp_path: Path, held_stage: threading.Event
) -> None:
    w = torch.full((1 << 16,), 1.0)
    config = _background(guard_optimizers=False, guard_modules=False)
    with AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1, config=config) as ck:
        held_stage.set()
        ck.save({"w": w}, 1).result(timeout=60)
        held_stage.clear()
        fut = ck.save({"w": w}, 2)
        w.add_(1.0)  # no guard: the caller breaks the rule while the copy waits
        held_stage.set()
        with pytest.raises(StagingConflictError):
            fut.result(timeout=60)
        with pytest.raises(StagingConflictError):
            ck.wait()
    # The torn step 2 was never committed; step 1 is still there and whole.
    snaps = find_snapshots(memory.folder, 0, 1)
    assert [s.step for s in snaps] == [1]
    assert torch.equal(load_snapshot(snaps[0])["w"], torch.full((1 << 16,), 1.0))


def test_the_optimizer_step_waits_for_a_background_ram_copy(
    memory: SnapshotMemory, tmp_path: Path, held_stage: threading.Event
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(8, 256)).sum().backward()
    before = model.weight.detach().clone()
    with AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1, config=_background()) as ck:
        fut = ck.save({"model": model.state_dict()}, 1)
        # The copy is held; the step must wait for it (the guard), so a thread
        # releases it once the main thread is inside opt.step's pre-hook.
        waiting = threading.Thread(target=held_stage.set)
        timer = threading.Timer(0.2, waiting.start)
        timer.start()
        opt.step()
        timer.join()
        waiting.join()
        # The guard waits for the copy, not the commit after it (checksums, record):
        # the future may still be finishing; what proves the wait is the content below.
        assert fut.result(timeout=30).ram_only
    snap = find_snapshots(memory.folder, 0, 1)[0]
    assert torch.equal(load_snapshot(snap)["model"]["weight"], before)
    assert not torch.equal(model.weight, before)


def test_copy_threads_are_started_once_and_reused() -> None:
    src = [torch.full((1 << 16,), float(i)) for i in range(6)]
    dst = [torch.empty(1 << 16) for _ in range(6)]
    _run_copies(list(zip(dst, src, strict=True)), threads=3)
    pool = _copy_pool._pool
    for _ in range(5):
        _run_copies(list(zip(dst, src, strict=True)), threads=3)
    # The same pool, and no more threads than it holds (a pool grown by an earlier test
    # may start its idle threads lazily, so the set of threads itself may grow).
    assert pool is not None and _copy_pool._pool is pool
    copying = [t for t in threading.enumerate() if t.name.startswith("stalwart-copy")]
    assert 0 < len(copying) <= _copy_pool._size
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))


def test_prefaulting_a_segment_leaves_the_other_threads_running(tmp_path: Path) -> None:
    # mmap.madvise held the GIL for the whole pre-faulting: 0.6 s per GiB during which
    # the training thread stood still.
    base = tmp_path / "shm"
    base.mkdir()
    mem = SnapshotMemory(1, 256 << 20, base=base)
    try:
        seg = RamSegment.open(mem.folder / rl.segment_name(0))  # fresh: pre-faults at once
        try:
            populating = seg._populating
            assert populating is not None
            turns = 0
            while populating.is_alive():
                turns += 1
                time.sleep(0)  # lets go of the GIL; the loop runs whenever it can get it
        finally:
            seg.close()
    finally:
        mem.close()
    assert turns >= 10


def test_a_restarted_worker_restores_before_prefaulting_and_starts_its_writer_when_needed(
    memory: SnapshotMemory, tmp_path: Path
) -> None:
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    seg = RamSegment.open(memory.folder / rl.segment_name(0))
    seg.write(plan(state), 5, rank=0, world_size=1)
    seg.close()
    config = CheckpointerConfig(persist_every=100)
    with AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1, config=config) as ck:
        # Neither takes a core from the restore that comes first.
        assert ck._ram is not None and ck._ram._populating is None
        assert ck._writer is None and ck.writer_pid is None
        into = {"w": torch.zeros(1 << 16)}
        found = ck.restore(into=into)
        assert found is not None and (found.step, found.source) == (5, "ram")
        assert torch.equal(into["w"], state["w"])
        assert ck._ram._populating is not None
        assert ck.save({"w": into["w"] + 1}, 6).result(timeout=60).ram_only
        assert ck._writer is None  # RAM-only saves need no writer
        ck.wait_ready(60)
        assert ck.writer_pid is not None
    with AsyncCheckpointer(tmp_path / "fresh", rank=0, world_size=1, config=config) as ck:
        # Snapshots in the segment: a restart again. A fresh job has none.
        assert ck._writer is None
    memory.close()
    with AsyncCheckpointer(tmp_path / "none", rank=0, world_size=1, config=config) as ck:
        assert ck._ram is None and ck._writer is not None


_FORKED = textwrap.dedent(
    """
    import os, sys, torch
    from stalwart.checkpoint.staging import _run_copies
    def copy(v):
        src = [torch.full((1 << 14,), v) for _ in range(4)]
        dst = [torch.empty(1 << 14) for _ in range(4)]
        _run_copies(list(zip(dst, src)), threads=2)
        return all(torch.equal(d, s) for d, s in zip(dst, src))
    assert copy(1.0)
    pid = os.fork()
    if pid == 0:  # a warm worker: forked after the parent's pool started
        os._exit(0 if copy(2.0) else 3)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


def test_a_forked_child_gets_its_own_copy_threads() -> None:
    res = subprocess.run([sys.executable, "-c", _FORKED], timeout=90, env=dict(os.environ))
    assert res.returncode == 0
