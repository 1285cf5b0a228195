"""A stranger who reaches the job's rendezvous store (any process on the host, or on the
network for a multi-node job) and writes the records that steer the job: the job's end,
a node's failure. With a job secret the records are sealed, so the stranger's are
refused (one log line per key) and the job runs on; the secret itself never reaches the
workers' environment (nor what they start)."""

from __future__ import annotations

import json
import socket
import subprocess
from datetime import timedelta
from pathlib import Path
from typing import IO

import pytest

from tests.helpers import (
    ROOT,
    STALWART,
    STARTED,
    clean_env,
    events,
    free_port,
    kinds,
    stalwart,
    wait_for,
)

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(150)]

WORKER = Path(__file__).parent / "strangers_worker.py"
SECRET = "stalwart-test-secret-" + "7" * 32
REFUSED = "refused the value at rendezvous store key"


def _launch(node: int, port: int, out: Path, err: IO[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            *STALWART,
            "run",
            *("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node)),
            *("--master-addr", "127.0.0.1", "--master-port", str(port)),
            *("--rdzv-id", "strangers", "--log-dir", str(out / f"n{node}")),
            str(WORKER),
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=err,
        text=True,
        env=clean_env(STALWART_JOB_SECRET=SECRET),
        cwd=ROOT,
    )
    STARTED.append(proc)
    return proc


def test_stranger_cannot_end_or_fail_a_static_job(tmp_path: Path) -> None:
    from torch.distributed import TCPStore

    port = free_port()
    err0, err1 = tmp_path / "n0.err", tmp_path / "n1.err"
    with open(err0, "w") as e0, open(err1, "w") as e1:
        node0 = _launch(0, port, tmp_path, e0)

        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_for(listening, 60, "node 0 to host the job's store", interval=0.1)
        stranger = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        wait_for(lambda: stranger.check(["run_id"]), 30, "the job's run id")
        # Node 0 waits for node 1; a stranger says the job is over (exit 0, "succeeded").
        stranger.set("job/ended", json.dumps({"succeeded": True, "reason": "a stranger"}))
        wait_for(
            lambda: f"{REFUSED} job/ended" in err0.read_text() or node0.poll() is not None,
            30,
            "node 0 to refuse the stranger's job end",
        )
        assert node0.poll() is None, err0.read_text()[-2000:]

        node1 = _launch(1, port, tmp_path, e1)
        wait_for(
            lambda: all((tmp_path / f"ready_{r}").exists() for r in range(2)),
            90,
            "both workers to start",
        )
        # A well-formed failure record for node 1, then the flag every node polls.
        stranger.set(
            "r0/failure/1",
            json.dumps({"kind": "worker", "node_rank": 1, "local_rank": 0, "reason": "forged"}),
        )
        stranger.set("r0/failed", "1")
        wait_for(
            lambda: f"{REFUSED} r0/failed" in err0.read_text() + err1.read_text(),
            30,
            "a node to refuse the stranger's failure flag",
        )
        # Counters carry no MAC: a non-number in one made the store drop the next node
        # that added to it (the job read as having lost its store). Done and left are
        # sealed keys per node now.
        stranger.set("r0/done", "not a number")
        stranger.set("left", "not a number")
        (tmp_path / "go").touch()
        assert node0.wait(60) == 0, err0.read_text()[-2000:]
        assert node1.wait(60) == 0, err1.read_text()[-2000:]
    for n in range(2):
        evs = kinds(events(tmp_path / f"n{n}"))
        assert "restart" not in evs and "peer_failure" not in evs, evs
        assert "job_succeeded" in evs, evs
    text = err0.read_text() + err1.read_text()
    assert "Traceback" not in text, text[-2000:]
    # Logged once per key and node, however often the node polled it.
    assert err0.read_text().count(f"{REFUSED} job/ended") == 1, text[-2000:]
    for r in range(2):
        assert (tmp_path / f"secret_seen_{r}").read_text() == "", r
        assert (tmp_path / f"key_mode_{r}").read_text() == "0o600", r


def test_the_job_secret_is_not_in_a_workers_environment(tmp_path: Path) -> None:
    # One node (its own secret is drawn, but a given one must not leak either); a program
    # that is not Python at all prints its environment.
    res = stalwart(
        "--no-python",
        "--log-dir",
        tmp_path,
        "env",
        env=clean_env(STALWART_JOB_SECRET=SECRET),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "PATH=" in res.stdout, res.stdout[-2000:]
    assert SECRET not in res.stdout, "the worker's environment shows the job secret"
