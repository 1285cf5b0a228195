"""Fixtures for monitor tests: a started NodeMonitor, worker subprocesses, a timer server."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart.monitor import MonitorConfig, NodeMonitor
from stalwart.monitor.timer_server import ExpiredTimer, TimerServer
from tests.helpers import wait_for

WORKER = Path(__file__).with_name("worker.py")


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.monitor: NodeMonitor | None = None
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, config: MonitorConfig, nranks: int = 1, state_dir: Path | None = None
    ) -> NodeMonitor:
        self.monitor = NodeMonitor(
            self.tmp_path / "run",
            config,
            nranks,
            lambda e, f: self.events.append((e, f)),
            state_dir=state_dir,
        )
        self.monitor.start()
        return self.monitor

    def spawn(
        self, local_rank: int, *args: str, extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        assert self.monitor is not None
        env = dict(os.environ)
        env.update(self.monitor.worker_env(local_rank, local_rank))
        env.update(extra_env or {})
        with (
            open(self.stdout_path(local_rank), "wb") as out,
            open(self.stderr_path(local_rank), "wb") as err,
        ):
            proc = subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                env=env,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def stdout_path(self, local_rank: int) -> Path:
        return self.tmp_path / f"rank{local_rank}.out"

    def stderr_path(self, local_rank: int) -> Path:
        return self.tmp_path / f"rank{local_rank}.err"

    def wait_ready(self, local_rank: int, timeout: float = 30) -> None:
        proc = self.procs[local_rank] if local_rank < len(self.procs) else None

        def ready() -> bool:
            if b"READY" in self.stdout_path(local_rank).read_bytes():
                return True
            if proc is not None and proc.poll() is not None:
                err = self.stderr_path(local_rank).read_text(errors="replace")[-2000:]
                raise AssertionError(f"rank {local_rank} exited with {proc.returncode}: {err}")
            return False

        wait_for(ready, timeout, f"rank {local_rank} READY")

    def event_names(self) -> list[str]:
        return [e for e, _ in self.events]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        if self.monitor is not None:
            self.monitor.stop()


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[TimerServer, list[ExpiredTimer]]]:
    """A real timer server on its pipe, and the timers it found expired."""
    expired: list[ExpiredTimer] = []
    srv = TimerServer(tmp_path / "timer.pipe", on_expired=expired.append)
    srv.open()
    yield srv, expired
    srv.stop()
