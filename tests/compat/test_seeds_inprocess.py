"""NVIDIA ``inprocess``'s monitor-thread helpers and logging behaviour (issue 26 item 1):
``monitor_thread.async_raise`` and ``reraise_if_unraisable`` exist under NVIDIA's module
path and do what its tests check; a restart that lands in a destructor is raised again
instead of being lost; an unconfigured logging setup is warned about, and a configured
one hears of the first iteration."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import stalwart.inprocess as inprocess
from tests.helpers import clean_env, free_port
from tests.inprocess.harness import launch

PROGRAM = Path(__file__).parent / "programs" / "seeds_inprocess.py"


class Planted(Exception):
    pass


@pytest.mark.timeout(20)
def test_async_raise_reaches_the_main_thread() -> None:
    main = threading.main_thread().ident
    assert main is not None
    thread = threading.Thread(target=inprocess.monitor_thread.async_raise, args=(main, Planted))
    with pytest.raises(Planted):
        thread.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.001)
    thread.join()


def test_async_raise_names_a_thread_that_does_not_exist() -> None:
    with pytest.raises(RuntimeError, match="no running thread with id 1234567"):
        inprocess.monitor_thread.async_raise(1234567, Planted)


class _RaisesWhenFreed:
    def __del__(self) -> None:
        raise Planted


@pytest.mark.timeout(20)
def test_an_exception_python_could_not_raise_is_raised_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    before = sys.unraisablehook
    with pytest.raises(Planted), inprocess.monitor_thread.reraise_if_unraisable(Planted):
        obj = _RaisesWhenFreed()
        del obj
        gc.collect()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.001)
    # the hook in place before was called too, and is back even though the block raised
    assert [u.exc_type for u in seen] == [Planted]
    assert sys.unraisablehook is before


def test_other_unraisable_exceptions_are_left_to_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)

    @inprocess.monitor_thread.reraise_if_unraisable(KeyError)
    def run() -> None:
        obj = _RaisesWhenFreed()
        del obj
        gc.collect()
        for _ in range(1000):
            time.sleep(0)

    run()
    assert [u.exc_type for u in seen] == [Planted]


@pytest.mark.timeout(120)
def test_a_restart_landing_in_a_destructor_is_not_lost() -> None:
    """Rank 0 spends most of its time (0.5 s of every 0.53 s) in a destructor when rank 1
    fails: a restart raised there is one Python can only report as unraisable.  Before,
    rank 0 went on with the failed iteration until its own deadline whenever the restart
    landed in the destructor (most runs; when it lands in the 0.03 s outside, this test
    passes on the old code too)."""
    r0, r1 = launch("destructor", world_size=2, timeout=100, program=PROGRAM)
    for r in (r0, r1):
        assert r.returncode == 0, r.output[-3000:]
        assert [e["iteration"] for e in r.of("enter")] == [0, 1], r.output[-3000:]
        assert r.of("result")[-1]["value"] == 1, r.output[-3000:]
    assert not r0.of("restart_lost")


def _one_rank(scenario: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    env.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        MONITOR_LOG=str(tmp_path / "monitor.log"),
    )
    return subprocess.run(
        [sys.executable, str(PROGRAM), scenario],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.timeout(90)
def test_unconfigured_logging_is_warned_about_and_configured_logging_is_used(
    tmp_path: Path,
) -> None:
    quiet = _one_rank("quiet", tmp_path)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "UserWarning: logging is not configured" in quiet.stderr, quiet.stderr[-3000:]
    debug = _one_rank("debug", tmp_path)
    assert debug.returncode == 0, debug.stderr[-3000:]
    assert "enters iteration 0 as rank 0/1" in debug.stdout, debug.stdout[-3000:]
    assert "logging is not configured" not in debug.stderr
    # the monitor process tells the rank's stderr of trouble only, and its log file
    # (asked for) that it started and whom it watched, though the function returned at once
    assert "monitor_process" not in debug.stderr
    events = [json.loads(x[6:]) for x in debug.stdout.splitlines() if x.startswith("EVENT ")]
    pid = events[-1]["pid"]
    # 0.2's wording and 0.4's (NVIDIA's tests look for one each)
    started = (tmp_path / "monitor.log").read_text()
    assert f"training_pid={pid} " in started and f"target_pid={pid} " in started
