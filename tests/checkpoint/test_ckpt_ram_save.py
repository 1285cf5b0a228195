"""The save path into the launcher's memory: background staging, its guards, copy threads.

Real segments made by the launcher's own class, a real model and optimizer; the copy
thread is held on an event so the order of events is certain, not a guess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
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
from stalwart.checkpoint.staging import _run_copies
from stalwart.launch.snapshots import SnapshotMemory

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SnapshotMemory]:
    base = tmp_path / "shm"
    base.mkdir()
    mem = SnapshotMemory(1, 8 << 20, base=base)
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(mem.folder))
    monkeypatch.setenv("LOCAL_RANK", "0")
    yield mem
    mem.close()


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
        assert fut.done() and fut.result().ram_only
    snap = find_snapshots(memory.folder, 0, 1)[0]
    assert torch.equal(load_snapshot(snap)["model"]["weight"], before)
    assert not torch.equal(model.weight, before)


def test_copy_threads_are_started_once_and_reused() -> None:
    src = [torch.full((1 << 16,), float(i)) for i in range(6)]
    dst = [torch.empty(1 << 16) for _ in range(6)]
    _run_copies(list(zip(dst, src, strict=True)), threads=3)
    names = {t.ident for t in threading.enumerate() if t.name.startswith("stalwart-copy")}
    for _ in range(5):
        _run_copies(list(zip(dst, src, strict=True)), threads=3)
    again = {t.ident for t in threading.enumerate() if t.name.startswith("stalwart-copy")}
    assert names and again == names
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))


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
