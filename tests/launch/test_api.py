"""The Python API: start workers from a function or a program, wait, poll, close."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from stalwart.launch.files.logs import LogSpec, Std
from stalwart.launch.workers.posix import ExitWatcher
from stalwart.launch.workers.processes import start_processes
from tests.helpers import alive, wait_for

from . import funcs
from .helpers import SCRIPTS

pytestmark = pytest.mark.timeout(60)


def _logs(tmp_path: Path, n: int, redirects: Std = Std.ALL) -> dict:
    spec = LogSpec(tmp_path / "run", redirects=redirects)
    return spec.make(0, n, {i: i for i in range(n)}, "default", 0)


def _envs(n: int) -> dict[int, dict[str, str]]:
    return {i: {"RANK": str(i), "LOCAL_RANK": str(i), "WORLD_SIZE": str(n)} for i in range(n)}


def test_function_return_values_per_rank(tmp_path: Path) -> None:
    ctx = start_processes(funcs.square, {0: (3,), 1: (4,)}, _envs(2), _logs(tmp_path, 2))
    result = ctx.wait(timeout=30, period=0.05)
    assert result is not None and not result.is_failed()
    assert result.return_values == {0: 9, 1: 16}
    assert Path(result.stdouts[1]).read_text() == "square of 4\n"
    assert result.stdouts[0].endswith("attempt_0/0/stdout.log")


def test_function_sees_its_env_and_large_values_do_not_deadlock(tmp_path: Path) -> None:
    ctx = start_processes(funcs.rank_info, {0: (), 1: ()}, _envs(2), _logs(tmp_path, 2))
    result = ctx.wait(30, 0.05)
    assert result is not None
    assert result.return_values[1] == {"rank": "1", "world": "2"}
    big = start_processes(funcs.big_value, {0: (8 << 20,)}, _envs(1), _logs(tmp_path / "b", 1))
    result = big.wait(30, 0.05)
    assert result is not None and len(result.return_values[0]) == 8 << 20


def test_mixed_success_and_failure_is_all_or_nothing(tmp_path: Path) -> None:
    ctx = start_processes(funcs.fail_on_one, {0: (1,), 1: (2,)}, _envs(2), _logs(tmp_path, 2))
    result = ctx.wait(30, 0.05)
    assert result is not None and result.is_failed()
    assert result.return_values == {}
    failure = result.failures[1]
    assert failure.exitcode == 1 and failure.local_rank == 1
    assert failure.message == "ValueError: bad input 2"  # read back from error.json
    assert "fail_on_one" in failure.traceback


def test_poll_wait_timeout_pids_and_close(tmp_path: Path) -> None:
    ctx = start_processes(funcs.sleep_forever, {0: (), 1: ()}, _envs(2), _logs(tmp_path, 2))
    assert ctx.poll() is None
    t0 = time.monotonic()
    assert ctx.wait(timeout=0.3, period=0.05) is None
    assert time.monotonic() - t0 >= 0.3
    pids = ctx.pids()
    assert set(pids) == {0, 1} and all(alive(p) for p in pids.values())
    ctx.close(death_sig=signal.SIGINT, timeout=5)
    assert not any(alive(p) for p in pids.values())
    info = ctx.exit_info()
    assert all(code is not None for _, _, code, _ in info.values())
    # Every exit has its time, also one the exit watcher missed at the teardown.
    assert all(when is not None for _, _, _, when in info.values()), info


def test_close_reads_the_process_table_once_before_signalling_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The survivors' SIGTERM waits on one pass over the process table, however many
    workers there are (it was one pass per worker: nproc passes, each over every
    process of the host, before the first signal); what a worker started that left its
    group (setsid) is still found by that pass and killed."""
    n = 4
    # Each worker starts a child in a session of its own, then sleeps.
    body = 'setsid sleep 300 & echo $! > "$0"; exec sleep 300'
    args = {lr: ("-c", body, str(tmp_path / f"stray{lr}")) for lr in range(n)}
    ctx = start_processes("/bin/sh", args, _envs(n), _logs(tmp_path, n))
    strays = [
        int(wait_for(lambda lr=lr: _read(tmp_path / f"stray{lr}"), 30, f"stray {lr}"))
        for lr in range(n)
    ]
    assert all(alive(p) for p in strays)
    steps: list[str] = []
    listdir, kill, killpg = os.listdir, os.kill, os.killpg

    def spy_listdir(path: Any = ".") -> list[Any]:
        if os.fsdecode(path) == "/proc":
            steps.append("table")
        return listdir(path)

    def spy_kill(pid: int, sig: int) -> None:
        steps.append("signal")
        kill(pid, sig)

    def spy_killpg(pgid: int, sig: int) -> None:
        steps.append("signal")
        killpg(pgid, sig)

    monkeypatch.setattr(os, "listdir", spy_listdir)
    monkeypatch.setattr(os, "kill", spy_kill)
    monkeypatch.setattr(os, "killpg", spy_killpg)
    try:
        ctx.close(signal.SIGTERM, timeout=5)
    finally:
        monkeypatch.undo()
    assert steps.index("signal") == 1 and steps[0] == "table", steps
    wait_for(lambda: not any(alive(p) for p in strays), 10, "the strays killed")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


def test_the_exit_watcher_records_an_exit_that_comes_with_its_wake_up() -> None:
    """The teardown wakes the watcher to stop it; a worker that died just then (its
    pidfd ready in the same poll) still gets its exit time."""

    @dataclass
    class Handle:
        pid: int
        exited_at: float | None = None

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # Exited but not reaped: its pidfd is readable.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    watcher = ExitWatcher()
    handle = Handle(child.pid)
    try:
        watcher.watch(handle)
        os.write(watcher._w, b"x")  # the wake-up close() sends, before the thread polls
        watcher.start()
        watcher._thread.join(10)
        assert handle.exited_at is not None
    finally:
        watcher.close()
        child.wait()


def test_program_worker_and_exit_code(tmp_path: Path) -> None:
    envs = _envs(2)
    ctx = start_processes(
        sys.executable,
        {0: ("-c", "import sys; sys.exit(0)"), 1: ("-c", "import sys; sys.exit(4)")},
        envs,
        _logs(tmp_path, 2),
    )
    result = ctx.wait(30, 0.05)
    assert result is not None and result.failures[1].exitcode == 4
    assert 0 not in result.failures


def test_fd_level_redirect_of_function_worker(tmp_path: Path) -> None:
    ctx = start_processes(funcs.write_both, {0: ()}, _envs(1), _logs(tmp_path, 1))
    result = ctx.wait(30, 0.05)
    assert result is not None and not result.is_failed()
    assert Path(result.stdouts[0]).read_text() == "to stdout\nraw fd write\n"
    assert Path(result.stderrs[0]).read_text() == "to stderr\n"


def test_mismatched_rank_maps_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="same local ranks"):
        start_processes(funcs.square, {0: (1,)}, _envs(2), _logs(tmp_path, 2))
    assert os.path.exists(SCRIPTS)
