"""The process primitives, against real processes: a live child, a zombie, a reaped pid."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stalwart.inprocess
from stalwart.base import procs
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(30)


def test_live_zombie_and_reaped_child() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        assert procs.is_alive(child.pid)
        assert procs.exists(child.pid)
        assert procs.parent(child.pid) == os.getpid()
        started = procs.start_time(child.pid)
        assert started is not None and started == procs.start_time(child.pid)
        assert procs.is_descendant(child.pid, os.getpid())
    finally:
        assert child.stdin is not None
        child.stdin.close()
    # Exited but not yet waited for: a zombie still has a table entry and runs nothing.
    wait_for(lambda: procs.state(child.pid) == "Z", 10, "the child to be a zombie", 0.01)
    assert procs.exists(child.pid)
    assert not procs.is_alive(child.pid)
    child.wait()
    assert not procs.exists(child.pid)
    assert not procs.is_alive(child.pid)
    assert procs.start_time(child.pid) is None


def test_parent_is_names_only_the_parent() -> None:
    assert procs.parent_is(os.getppid())
    assert not procs.parent_is(os.getpid())


def test_never_signals_itself_or_init() -> None:
    assert not procs.signal_pid(os.getpid(), 0)
    assert not procs.signal_pid(1, 0)


def test_reaper_starts_isolated_and_leaves_when_its_parent_is_not_there(tmp_path: Path) -> None:
    """The hard-timeout reaper runs as ``python -I <file>``: no PYTHONPATH, no script
    folder on the path.  It must still find the base layer it imports, and a reaper
    whose parent is not the pid it was told (that rank is gone) removes the clock file
    and exits 0."""
    clock = tmp_path / "clock"
    clock.write_bytes(struct.pack("<dddd", time.monotonic(), 0.0, 0.0, 0.0))
    script = Path(stalwart.inprocess.__file__).with_name("_reaper.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [
            sys.executable,
            "-I",
            str(script),
            *("--parent", "1", "--clock", str(clock), "--rank", "0"),
            *("--interval", "0.01", "--hard-timeout", "60", "--grace", "1"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert done.returncode == 0, done.stderr
    assert not clock.exists()
