"""Failure behaviour: killed writers, full disks, unwritable folders, corruption."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import signal
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_state, remount_read_only

from stalwart.checkpoint import (
    AsyncCheckpointer,
    CheckpointCorruptError,
    WriterDiedError,
    WriterError,
    load_latest,
    verify_step,
)


def _latest(root: Path) -> str:
    return str((root / "latest").readlink())


def _live_writer_pid(
    ckpt: AsyncCheckpointer, fut: Future[object], deadline_s: float = 30.0
) -> int | None:
    """The writer serving *fut*; None when *fut* already failed against the writer the
    previous trial killed (a kill that lands just after a save completed is only seen by
    the next save, which then fails clearly; the one after that respawns)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pid = ckpt.writer_pid
        if pid is not None:
            return pid
        if fut.done():
            return None
        time.sleep(0.01)
    raise AssertionError("no writer process came up")


@pytest.mark.timeout(120)
def test_sigkill_of_writer_at_random_points_keeps_latest_loadable(tmp_path: Path) -> None:
    rng = random.Random(1234)
    trials = 20
    outcomes = {"ok": 0, "killed": 0}
    with AsyncCheckpointer(tmp_path, keep_last=3, rank=0, world_size=1) as ckpt:
        ckpt.save(make_state(0, mib=8), step=0).result(timeout=60)
        t0 = time.monotonic()
        ckpt.save(make_state(0, mib=8), step=0).result(timeout=60)
        write_s = time.monotonic() - t0
        last_ok = 0
        for trial in range(1, trials + 1):
            fut = ckpt.save(make_state(trial, mib=8), step=trial)
            pid = _live_writer_pid(ckpt, fut)
            if pid is not None:
                # Kill anywhere from "request not read yet" to "already committed".
                time.sleep(rng.uniform(0.0, 1.5 * write_s))
                # The pid can be the writer the previous trial killed, not yet noticed
                # by the checkpointer: this save then fails against it, which is one
                # more kill point, not a test error.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                fut.result(timeout=60)
                outcomes["ok"] += 1
                last_ok = trial
            except WriterDiedError:
                outcomes["killed"] += 1
            found = load_latest(tmp_path, rank=0)
            assert found is not None, f"trial {trial}: nothing loadable"
            # Never older than the last save reported done; at most this trial's
            # step (killed after its commit but before the reply is fine).
            assert last_ok <= found.step <= trial, (trial, last_ok, found.step)
            expected = make_state(found.step, mib=8)
            assert torch.equal(found.state_dict["w"], expected["w"])
            verify_step(tmp_path, found.step, rank=0)
            # `latest` only ever names a complete, verifying step.
            latest_step = int(_latest(tmp_path).split("_")[1])
            verify_step(tmp_path, latest_step, rank=0)
        # The next save respawns the writer, which also sweeps abandoned temp folders.
        ckpt.save(make_state(99, mib=1), step=99).result(timeout=60)
    assert not list(tmp_path.glob(".tmp-*"))
    found = load_latest(tmp_path, rank=0)
    assert found is not None and found.step == 99
    assert outcomes["killed"] > 0, outcomes  # the random points did hit live writes


@pytest.mark.timeout(60)
def test_disk_full_fails_cleanly(small_tmpfs: Path) -> None:
    root = small_tmpfs / "ckpt"
    with AsyncCheckpointer(root, keep_last=3, rank=0, world_size=1) as ckpt:
        ckpt.save(make_state(1, mib=0.25), step=1).result(timeout=30)
        before = sorted(p.name for p in root.iterdir())
        fut = ckpt.save(make_state(2, mib=3), step=2)  # does not fit in 2 MiB
        with pytest.raises(WriterError) as info:
            fut.result(timeout=30)
        assert info.value.errno == errno.ENOSPC
        assert "No space left on device" in str(info.value)
        assert "previous checkpoint is untouched" in str(info.value)
        # Nothing half-written is left, `latest` did not move.
        assert sorted(p.name for p in root.iterdir()) == before
        assert _latest(root) == "step_000000001"
        found = load_latest(root, rank=0)
        assert found is not None and found.step == 1
        assert torch.equal(found.state_dict["w"], make_state(1, mib=0.25)["w"])
        # Once it fits again, saving works again.
        ckpt.save(make_state(3, mib=0.25), step=3).result(timeout=30)
    assert _latest(root) == "step_000000003"


@pytest.mark.timeout(60)
def test_unwritable_directory_fails_cleanly(bind_mount: Path) -> None:
    # Root ignores permission bits (chmod 0500 would not stop this test's root
    # user), so the folder is made unwritable with a read-only bind mount: the
    # save meets EROFS rather than EACCES, through the same error path.
    root = bind_mount
    with AsyncCheckpointer(root, keep_last=3, rank=0, world_size=1) as ckpt:
        ckpt.save(make_state(1), step=1).result(timeout=30)
        if not remount_read_only(root):
            pytest.skip("kernel refused a read-only remount")
        with pytest.raises(WriterError) as info:
            ckpt.save(make_state(2), step=2).result(timeout=30)
        assert info.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
        assert "step 2" in str(info.value)
        assert _latest(root) == "step_000000001"
        found = load_latest(root, rank=0)
        assert found is not None and found.step == 1


@pytest.mark.timeout(30)
def test_directory_under_a_file_is_refused_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    with pytest.raises(OSError):
        AsyncCheckpointer(blocker / "ckpt", rank=0, world_size=1)


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.timeout(60)
def test_corrupt_and_torn_checkpoints_are_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with AsyncCheckpointer(tmp_path, keep_last=5, rank=0, world_size=1) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(make_state(step), step=step)
        ckpt.wait()
    # 4: a flipped byte in the middle of the tensor data.
    data4 = tmp_path / "step_000000004" / "rank_0.pt"
    _flip_byte(data4, data4.stat().st_size // 2)
    # 3: torn, the manifest never made it (as if killed before the commit).
    (tmp_path / "step_000000003" / "rank_0.manifest.json").unlink()
    # 2: truncated data file.
    data2 = tmp_path / "step_000000002" / "rank_0.pt"
    os.truncate(data2, data2.stat().st_size - 100)

    with pytest.raises(CheckpointCorruptError, match=r"checksum|crc32|xxh3"):
        verify_step(tmp_path, 4, rank=0)
    with caplog.at_level(logging.WARNING, logger="stalwart.checkpoint"):
        found = load_latest(tmp_path, rank=0)
    assert found is not None and found.step == 1
    assert torch.equal(found.state_dict["w"], make_state(1)["w"])
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 3, skipped
    assert any("step 4" in m for m in skipped)


@pytest.mark.timeout(30)
def test_nothing_to_load(tmp_path: Path) -> None:
    assert load_latest(tmp_path / "missing", rank=0) is None
    assert load_latest(tmp_path, rank=0) is None
