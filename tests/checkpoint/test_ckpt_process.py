"""The writer subprocess on its own: handshake, timeouts, errors, death, shutdown."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from ckpt_helpers import ScriptedWriter, fail_init, sleep_forever

from stalwart.checkpoint import (
    CheckpointProcess,
    WriterDiedError,
    WriterError,
    WriterProcessConfig,
)
from tests.helpers import alive, wait_for


def _proc(tmp_path: Path, **cfg: float) -> CheckpointProcess:
    return CheckpointProcess(
        ScriptedWriter,
        {"out_dir": str(tmp_path)},
        config=WriterProcessConfig(**cfg),  # type: ignore[arg-type]
    )


def _wait_gone(pid: int) -> None:
    # Reaped children vanish; an unreaped zombie still counts as gone (helpers.alive).
    wait_for(lambda: not alive(pid), 10, f"writer {pid} to exit", 0.05)


@pytest.mark.timeout(30)
def test_init_that_never_answers_is_a_timeout(tmp_path: Path) -> None:
    proc = CheckpointProcess(
        ScriptedWriter,
        {"out_dir": str(tmp_path)},
        init_fn=sleep_forever,
        config=WriterProcessConfig(init_timeout_s=3.0),
    )
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not answer within 3 s"):
        proc.wait_ready()
    assert time.monotonic() - t0 < 15
    assert proc.pid is None  # the stuck child was killed, not left behind
    proc.close()


@pytest.mark.timeout(30)
def test_init_error_comes_back_with_child_traceback(tmp_path: Path) -> None:
    proc = CheckpointProcess(
        ScriptedWriter, {"out_dir": str(tmp_path)}, init_fn=fail_init, init_args=("no disk",)
    )
    with pytest.raises(WriterError) as info:
        proc.wait_ready()
    assert "init refused: no disk" in str(info.value)
    assert "fail_init" in info.value.remote_traceback
    proc.close()


@pytest.mark.timeout(60)
def test_error_in_writer_surfaces_and_next_write_works(tmp_path: Path) -> None:
    with _proc(tmp_path) as proc:
        proc.wait_ready()
        pid = proc.pid
        fut = proc.write({"t": torch.ones(3)}, "a.pt", mode="raise")
        with pytest.raises(WriterError) as info:
            fut.result(timeout=30)
        assert "scripted failure inside the writer" in str(info.value)
        assert "ScriptedWriter" in info.value.remote_traceback or "write" in (
            info.value.remote_traceback
        )
        assert info.value.remote_type.endswith("ValueError")
        res = proc.write({"t": torch.ones(3)}, "b.pt").result(timeout=30)
        assert res["pid"] == pid  # same child, still serving
    assert torch.equal(torch.load(tmp_path / "b.pt")["t"], torch.ones(3))


@pytest.mark.timeout(60)
def test_child_crash_mid_write_is_reported_and_next_write_respawns(tmp_path: Path) -> None:
    with _proc(tmp_path) as proc:
        proc.wait_ready()
        first_pid = proc.pid
        with pytest.raises(WriterDiedError, match="exit code 17"):
            proc.write({"t": torch.ones(3)}, "a.pt", mode="exit").result(timeout=30)
        res = proc.write({"t": torch.zeros(2)}, "b.pt").result(timeout=60)
        assert res["pid"] != first_pid
    assert torch.equal(torch.load(tmp_path / "b.pt")["t"], torch.zeros(2))


@pytest.mark.timeout(60)
def test_sigkill_during_write_is_detected_at_once(tmp_path: Path) -> None:
    with _proc(tmp_path) as proc:
        proc.wait_ready()
        pid = proc.pid
        assert pid is not None
        fut = proc.write({"t": torch.ones(3)}, "a.pt", mode="hang")
        # Mid-write or before it even read the request: either way the death
        # must surface promptly through the Future.
        assert not fut.done()
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WriterDiedError):
            fut.result(timeout=20)
        assert time.monotonic() - t0 < 5  # noticed through the process sentinel, no hang
        assert proc.write({"t": torch.ones(1)}, "c.pt").result(timeout=60)["pid"] != pid


@pytest.mark.timeout(60)
def test_write_timeout_kills_a_stuck_writer(tmp_path: Path) -> None:
    with _proc(tmp_path, write_timeout_s=1.5) as proc:
        proc.wait_ready()
        pid = proc.pid
        assert pid is not None
        with pytest.raises(TimeoutError):
            proc.write({"t": torch.ones(3)}, "a.pt", mode="hang").result(timeout=30)
        _wait_gone(pid)


@pytest.mark.timeout(60)
def test_close_stops_the_child(tmp_path: Path) -> None:
    proc = _proc(tmp_path, shutdown_timeout_s=5.0)
    proc.wait_ready()
    pid = proc.pid
    assert pid is not None
    fut = proc.write({"t": torch.ones(3)}, "a.pt")
    proc.close()  # finishes the queued write first
    assert fut.done() and fut.exception() is None
    _wait_gone(pid)
    with pytest.raises(RuntimeError, match="closed"):
        proc.write({"t": torch.ones(3)}, "b.pt")


@pytest.mark.timeout(60)
def test_close_kills_a_child_that_does_not_exit_in_time(tmp_path: Path) -> None:
    proc = _proc(tmp_path, shutdown_timeout_s=1.0)
    proc.wait_ready()
    pid = proc.pid
    assert pid is not None
    # The write succeeds, then the child stays busy and never reads the exit request.
    proc.write({"t": torch.ones(3)}, "a.pt", mode="stuck_after").result(timeout=30)
    t0 = time.monotonic()
    proc.close()
    assert time.monotonic() - t0 < 10
    _wait_gone(pid)
