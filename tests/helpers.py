"""What tests in every folder share: a clean environment, the ``stalwart run`` command line,
polling with a deadline, and reading a run's ``events.jsonl``.

Warm/cold starts: a test that starts workers through ``stalwart run`` and should prove both
start paths asks for it with ``@warm_and_cold`` (or ``pytestmark = warm_and_cold``); the
``start_mode`` fixture in ``tests/conftest.py`` then runs it twice and ``clean_env`` turns
warm starts off for the cold half; ``@cold_only`` runs it once, cold. Every other test runs
once, with stalwart's default (warm).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
STALWART = [sys.executable, "-m", "stalwart.cli"]

# Variables that steer a launcher, so a test that inherits them from the shell running
# pytest (a job's own environment, a SLURM allocation, a Kubernetes pod) would test
# something else: stalwart's own, torchrun's, SLURM's and the PyTorch operator's.
LAUNCHER_ENV_PREFIXES = ("STALWART_", "TORCHELASTIC_", "SLURM_", "PET_")
# Kubernetes' indexed Job and JobSet (a node rank and the master's name: see
# stalwart.cluster) and torchrun's own shutdown grace.
LAUNCHER_ENV_NAMES = (
    "JOB_COMPLETION_INDEX",
    "JOBSET_NAME",
    "REPLICATED_JOB_NAME",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
)

warm_and_cold = pytest.mark.usefixtures("start_mode")
"""Run the test twice: workers forked from the warm template, and cold."""
cold_only = pytest.mark.usefixtures("cold_start")
"""Run the test once, with warm starts off."""

# Set only by the ``start_mode`` fixture, for the test that asked for it.
START = {"warm": True}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that steers a launcher, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(LAUNCHER_ENV_PREFIXES) and k not in LAUNCHER_ENV_NAMES
    }
    env.pop("OMP_NUM_THREADS", None)
    if not START["warm"]:
        env["STALWART_WARM"] = "0"
    env.update(extra)
    return env


def stalwart_argv(*args: str | Path) -> list[str]:
    """The command line of ``stalwart run ARGS`` with this interpreter."""
    return [*STALWART, "run", *map(str, args)]


def stalwart(
    *args: str | Path, timeout: float = 90, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        stalwart_argv(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or clean_env(),
        cwd=ROOT,
    )


# Launchers started in the background by the running test; the conftest kills any that a
# failed test left running (its guardian then takes the workers).
STARTED: list[subprocess.Popen[str]] = []


def start_stalwart(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        stalwart_argv(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or clean_env(),
        cwd=ROOT,
    )
    STARTED.append(proc)
    return proc


def wait_for(
    cond: Callable[[], Any], timeout: float, what: str = "condition", interval: float = 0.02
) -> Any:
    """``cond()``'s first true value, polled every ``interval`` s until ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_listening(port: int, proc: subprocess.Popen[str], what: str, timeout: float = 60) -> None:
    """Until something accepts on 127.0.0.1:``port``; fails at once, with its output, if
    ``proc`` (the process meant to listen there) exits first."""

    def listening() -> bool:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        if proc.poll() is not None:
            out = proc.communicate()[0] if proc.stdout is not None else ""
            raise AssertionError(f"exited with {proc.returncode} before {what}:\n{out[-3000:]}")
        return False

    wait_for(listening, timeout, what, interval=0.05)


def read_events(path: Path) -> list[dict[str, Any]]:
    """The records of one ``events.jsonl``, in order."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_dir(log_dir: Path) -> Path:
    """The one run folder under ``log_dir``."""
    dirs = [d for d in log_dir.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def events(log_dir: Path) -> list[dict[str, Any]]:
    """The events of the one run under ``log_dir``."""
    return read_events(run_dir(log_dir) / "events.jsonl")


def kinds(evs: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in evs]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_STORE_HOST = """
import time
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                 timeout=timedelta(seconds=60))
print(store.port, flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def store_host_process() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A ``TCPStore`` hosted by a process of its own (to kill), and its port."""
    host = subprocess.Popen(
        [sys.executable, "-c", _STORE_HOST],
        stdout=subprocess.PIPE, text=True, env=clean_env(), cwd=ROOT,
    )  # fmt: skip
    try:
        assert host.stdout is not None
        yield host, int(host.stdout.readline())
    finally:
        host.kill()
        host.wait(timeout=30)
