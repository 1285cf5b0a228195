"""Staging: the background mode's guards and sizing the buffer before the first save."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from stalwart.checkpoint import (
    AsyncCheckpointer,
    CheckpointerConfig,
    StagingConflictError,
    StagingMode,
    load_latest,
)
from tests.helpers import wait_for


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    model.train()
    return model


@pytest.mark.timeout(60)
def test_background_staging_makes_forward_wait_for_the_snapshot(tmp_path: Path) -> None:
    model = _bn_model()
    before = model[1].running_mean.clone()
    cfg = CheckpointerConfig(staging=StagingMode.BACKGROUND)
    with AsyncCheckpointer(tmp_path, keep_last=2, rank=0, world_size=1, config=cfg) as ckpt:
        ckpt.wait_ready(timeout=30)
        # Hold the staging buffer so the snapshot cannot be taken yet.
        ckpt._process._buffer_free.acquire()
        fut = ckpt.save({"model": model.state_dict()}, step=1)
        forward_done = threading.Event()

        def forward() -> None:
            model(torch.randn(16, 4))  # BatchNorm updates running_mean in place
            forward_done.set()

        worker = threading.Thread(target=forward)
        worker.start()
        # The forward pre-hook holds the forward back while the snapshot is pending.
        assert not forward_done.wait(0.5)
        assert torch.equal(model[1].running_mean, before)
        ckpt._process._buffer_free.release()
        worker.join(timeout=30)
        assert forward_done.is_set()
        fut.result(timeout=30)
    assert not torch.equal(model[1].running_mean, before)
    found = load_latest(tmp_path, rank=0)
    assert found is not None
    assert torch.equal(found.state_dict["model"]["1.running_mean"], before)


@pytest.mark.timeout(60)
def test_without_the_module_guard_a_forward_during_staging_fails_the_save(tmp_path: Path) -> None:
    model = _bn_model()
    cfg = CheckpointerConfig(staging=StagingMode.BACKGROUND, guard_modules=False)
    with AsyncCheckpointer(tmp_path, keep_last=2, rank=0, world_size=1, config=cfg) as ckpt:
        ckpt.wait_ready(timeout=30)
        ckpt._process._buffer_free.acquire()
        fut = ckpt.save({"model": model.state_dict()}, step=1)
        model(torch.randn(16, 4))  # not held back: mutates before the copy
        ckpt._process._buffer_free.release()
        with pytest.raises(StagingConflictError):
            fut.result(timeout=30)


def _adam_model(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(width, width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    return model, opt


@pytest.mark.timeout(60)
def test_first_optimizer_step_sizes_the_buffer_for_model_and_optimizer(tmp_path: Path) -> None:
    model, opt = _adam_model(512)  # 1 MiB of weights, 2 MiB of Adam state
    with AsyncCheckpointer(tmp_path, keep_last=1, rank=0, world_size=1) as ckpt:
        assert ckpt._process._buffer.capacity == 0
        opt.step()
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        needed = sum(t.numel() * t.element_size() for t in state["model"].values())
        needed += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
        wait_for(lambda: ckpt._process._buffer.capacity >= needed, 30, "the buffer to grow", 0.01)
        capacity = ckpt._process._buffer.capacity
        ckpt.save(state, step=1).result(timeout=30)
        # The first save found its buffer ready: no growth, and nothing to trim.
        assert ckpt._process._buffer.capacity == capacity


@pytest.mark.timeout(60)
def test_a_provisional_reservation_is_trimmed_to_what_the_first_save_uses(tmp_path: Path) -> None:
    model, opt = _adam_model(1024)  # 4 MiB of weights, 8 MiB of Adam state
    with AsyncCheckpointer(tmp_path, keep_last=1, rank=0, world_size=1) as ckpt:
        opt.step()
        wait_for(lambda: ckpt._process._buffer.capacity >= 12 << 20, 30, "the buffer to grow", 0.01)
        # A model-only checkpoint needs a third of the estimate.
        ckpt.save({"model": model.state_dict()}, step=1).result(timeout=30)
        assert ckpt._process._buffer.capacity < 8 << 20
        found = load_latest(tmp_path, rank=0)
        assert found is not None
        assert torch.equal(found.state_dict["model"]["weight"], model.weight.detach())


@pytest.mark.timeout(60)
def test_auto_reserve_can_be_turned_off(tmp_path: Path) -> None:
    _, opt = _adam_model(256)
    cfg = CheckpointerConfig(auto_reserve=False)
    with AsyncCheckpointer(tmp_path, keep_last=1, rank=0, world_size=1, config=cfg) as ckpt:
        ckpt.wait_ready(timeout=30)
        opt.step()
        # Jobs on the I/O thread run in order: once this no-op reservation is
        # done, one the step had queued would be done too.
        ckpt.reserve_for({}).result(timeout=30)
        assert ckpt._process._buffer.capacity == 0


def _staging_rss_bytes() -> int:
    """Resident bytes of this process's mappings of the staging memory file."""
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = "stalwart-ckpt-staging" in line
        elif inside and fields[0] == "Rss:":
            rss += int(fields[1]) * 1024
    return rss


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps")
@pytest.mark.timeout(60)
def test_a_reservation_faults_the_pages_in_not_just_books_them(tmp_path: Path) -> None:
    # fallocate alone leaves every page to be faulted in by the first copy, on
    # the training thread: the cost a reservation exists to move off it.
    state = {"w": torch.randn(16 << 20 >> 2)}  # 16 MiB
    with AsyncCheckpointer(tmp_path, keep_last=1, rank=0, world_size=1) as ckpt:
        ckpt.reserve_for(state).result(timeout=30)
        capacity = ckpt._process._buffer.capacity
        assert capacity >= 16 << 20
        assert _staging_rss_bytes() >= capacity
