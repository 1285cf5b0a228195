"""Launches a scenario of ``worker.py`` as N real rank processes with torchrun's env vars."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.helpers import free_port

WORKER = Path(__file__).with_name("worker.py")


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int
    events: list[dict[str, Any]]
    output: str

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]


def launch(
    scenario: str,
    world_size: int = 2,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    program: Path = WORKER,
) -> list[RankResult]:
    port, store_port = free_port(), free_port()
    procs = []
    for rank in range(world_size):
        penv = dict(os.environ)
        penv.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            STALWART_INPROCESS_PORT=str(store_port),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        penv.update(env or {})
        procs.append(
            subprocess.Popen(
                [sys.executable, str(program), scenario],
                env=penv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            raise AssertionError(f"rank {rank} did not finish in {timeout}s:\n{out}") from None
        events = [
            json.loads(line[len("EVENT ") :])
            for line in out.splitlines()
            if line.startswith("EVENT ")
        ]
        results.append(RankResult(rank, proc.returncode, events, out))
    return results


def launch_torchrun(
    scenario: str, world_size: int = 2, timeout: float = 60.0, env: dict[str, str] | None = None
) -> tuple[int, list[dict[str, Any]], str]:
    """Run the scenario under plain ``torchrun`` (its own env vars and store)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    penv = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    penv.pop("STALWART_INPROCESS_PORT", None)
    penv.update(env or {})
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node",
        str(world_size),
        "--max-restarts",
        "0",
        str(WORKER),
        scenario,
    ]
    proc = subprocess.run(
        cmd, env=penv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    events = [
        json.loads(line[len("EVENT ") :])
        for line in proc.stdout.splitlines()
        if line.startswith("EVENT ")
    ]
    return proc.returncode, events, proc.stdout
