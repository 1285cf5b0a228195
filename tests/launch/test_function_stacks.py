"""A function worker's stack dump goes where ``STALWART_STACKS_FILE`` says, as a program
worker's does (both install ``stalwart.monitor.stacks``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stalwart.base import procs
from stalwart.launch.files.logs import LogSpec
from stalwart.launch.workers.processes import start_processes
from stalwart.monitor import envvars as monitor_env
from stalwart.monitor.stacks import STACK_SIGNAL
from tests.helpers import wait_for

from . import funcs

pytestmark = pytest.mark.timeout(60)


def test_function_worker_dumps_stacks_to_the_file_it_is_given(tmp_path: Path) -> None:
    stacks = tmp_path / "stacks.log"
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", monitor_env.STACKS_FILE: str(stacks)}
    logs = LogSpec(tmp_path / "run").make(0, 1, {0: 0}, "default", 0)
    ctx = start_processes(funcs.sleep_forever, {0: ()}, {0: env}, logs)
    try:
        pid = ctx.pids()[0]
        wait_for(lambda: procs.catches_signal(pid, STACK_SIGNAL), 30, "the stack-dump handler")
        os.kill(pid, STACK_SIGNAL)
        wait_for(lambda: stacks.exists() and "sleep_forever" in stacks.read_text(), 30, "the dump")
        assert ctx.poll() is None  # a dump does not stop the worker
    finally:
        ctx.close()
