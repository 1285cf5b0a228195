"""A function worker's stack dump goes where ``STALWART_STACKS_FILE`` says, as a program
worker's does (both install ``stalwart.monitor.stacks``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from stalwart.base import procs
from stalwart.launch.files.logs import LogSpec
from stalwart.launch.workers.processes import start_processes
from stalwart.monitor import envvars as monitor_env
from stalwart.monitor.stacks import STACK_SIGNAL

from . import funcs

pytestmark = pytest.mark.timeout(60)


def _until(cond: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not (callable(cond) and cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_function_worker_dumps_stacks_to_the_file_it_is_given(tmp_path: Path) -> None:
    stacks = tmp_path / "stacks.log"
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", monitor_env.STACKS_FILE: str(stacks)}
    logs = LogSpec(tmp_path / "run").make(0, 1, {0: 0}, "default", 0)
    ctx = start_processes(funcs.sleep_forever, {0: ()}, {0: env}, logs)
    try:
        pid = ctx.pids()[0]
        _until(lambda: procs.catches_signal(pid, STACK_SIGNAL), "the stack-dump handler")
        os.kill(pid, STACK_SIGNAL)
        _until(lambda: stacks.exists() and "sleep_forever" in stacks.read_text(), "the dump")
        assert ctx.poll() is None  # a dump does not stop the worker
    finally:
        ctx.close()
