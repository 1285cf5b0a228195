"""Our timer client against torch elastic's own FileTimerServer (TORCHELASTIC_TIMER_FILE)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import clean_env, wait_for

pytestmark = pytest.mark.timeout(60)

# torch's server signals its own process after reaping a worker, so it lives in its own.
SERVER = """
import sys, time
from torch.distributed.elastic.timer import FileTimerServer
server = FileTimerServer(sys.argv[1], "run", max_interval=0.05, daemon=True)
server.start()
time.sleep(60)
"""

WORKER = """
import os, time
from stalwart import timer
with timer.expires(after=0.5, scope="step"):
    open(os.environ["READY"], "w").close()
    time.sleep(30)
"""


def test_torch_server_reaps_a_worker_whose_timer_expired(tmp_path: Path) -> None:
    pipe = tmp_path / "watchdog"
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(pipe)])
    try:
        wait_for(pipe.exists, 30, "torch's timer server to create its pipe")
        ready = tmp_path / "ready"
        env = clean_env(TORCHELASTIC_TIMER_FILE=str(pipe), READY=str(ready))
        t0 = time.monotonic()
        worker = subprocess.Popen([sys.executable, "-c", WORKER], env=env)
        code = worker.wait(25)
        # Reaped with SIGKILL (the client's default, as torch's) long before its 30 s
        # sleep ended: torch's server saw the request although the worker never wrote
        # to the pipe again after acquiring.
        assert code == -9 and ready.exists()
        assert time.monotonic() - t0 < 15
    finally:
        server.kill()
        server.wait()
