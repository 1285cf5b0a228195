"""Quarantine on simulated hosts: a node that is the root cause of three failed rounds
in a row is kept out, and the elastic job goes on with the other two."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.netns import rdzv_args
from tests.helpers import events

from .conftest import Network

pytestmark = pytest.mark.timeout(240)

WORKER = Path(__file__).parent / "quarantine_worker.py"
FAST = (
    "keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=3,"
    "join_timeout=60,close_timeout=5"
)


def test_node_failing_three_rounds_is_quarantined_and_the_job_goes_on(
    network: Network, tmp_path: Path
) -> None:
    hosts = [network.add_host() for _ in range(3)]
    endpoint = f"{hosts[0].addr}:29511"
    bad = hosts[2]
    procs: list[subprocess.Popen[str]] = []
    for i, h in enumerate(hosts):
        args = rdzv_args(
            backend="c10d",
            endpoint=endpoint,
            nnodes="2:3",
            run_id="qjob",
            conf=FAST,
            max_restarts=5,
        )
        procs.append(
            h.stalwart(
                *args,
                "--shutdown-timeout",
                "3",
                "--log-dir",
                tmp_path / f"logs{i}",
                WORKER,
                tmp_path,
                log=tmp_path / f"n{i}.out",
                extra_env={"QUARANTINE_CRASH": "1"} if h is bad else None,
            )
        )
    for p in procs:
        p.wait(timeout=200)
    outs = [(tmp_path / f"n{i}.out").read_text() for i in range(3)]
    for i, p in enumerate(procs):
        assert p.returncode == 0, outs[i][-3000:]
    name = f"@{bad.addr}"
    # The bad node says why it left, once, after the third failed round (attempt 2).
    assert "is quarantined for the rest of the job" in outs[2], outs[2][-3000:]
    assert "implicated in 3 of the last 5 failed rounds" in outs[2]
    assert "the job goes on with the other 2 node(s)" in outs[2]
    # Attempt 3 ran on the two good nodes only, and finished.
    assert sorted(p.name for p in tmp_path.glob("done_3_*")) == ["done_3_0", "done_3_1"]
    assert (tmp_path / "done_3_0").read_text() == "2"
    for i in range(3):
        evs = events(tmp_path / f"logs{i}")
        quarantined = [e for e in evs if e["event"] == "node_quarantined"]
        assert len(quarantined) == 1, (i, quarantined)
        q = quarantined[0]
        assert q["node"].endswith(name) and q["since_attempt"] == 2, q
        assert q["causes"] == ["failed", "failed", "failed"], q
        assert q["until"] is None
    good = [e["event"] for e in events(tmp_path / "logs0")]
    assert "job_succeeded" in good, good
    bad_events = [e["event"] for e in events(tmp_path / "logs2")]
    assert bad_events.count("worker_spawn") == 3, bad_events
    assert "node_excluded" in bad_events and "job_succeeded" not in bad_events, bad_events
