"""Shared helpers for launcher tests: run ``stalwart run`` for real and read what it left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parents[2]
STALWART = [sys.executable, "-m", "stalwart.cli"]


# Set by conftest for each test: the launcher suite runs with warm starts on and off.
MODE = {"warm": True}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "TORCHELASTIC_"))}
    env.pop("OMP_NUM_THREADS", None)
    if not MODE["warm"]:
        env["STALWART_WARM"] = "0"
    env.update(extra)
    return env


def stalwart(
    *args: str | Path, timeout: float = 90, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*STALWART, "run", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or clean_env(),
        cwd=ROOT,
    )


def start_stalwart(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*STALWART, "run", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or clean_env(),
        cwd=ROOT,
    )


def run_dir(log_dir: Path) -> Path:
    dirs = [d for d in log_dir.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def events(log_dir: Path) -> list[dict[str, Any]]:
    path = run_dir(log_dir) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def kinds(evs: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in evs]


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
