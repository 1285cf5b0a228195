"""Quarantine end to end: on simulated hosts a node that is the root cause of three
failed rounds in a row is kept out and the elastic job goes on with the other two; a
static job (two launchers on this host) stops with one line naming the node."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.netns import Network, rdzv_args
from tests.helpers import ROOT, clean_env, events, free_port, kinds, stalwart_argv

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


def test_a_static_job_stops_with_one_line_naming_the_node(tmp_path: Path) -> None:
    """Fixed membership cannot go on without the quarantined node: the job stops after
    the third failed round (not at the restart budget of 5), both nodes exit 1, and the
    quarantined node prints the one line that names it and why."""
    port = str(free_port())
    procs = {}
    for n in (0, 1):
        env = {**clean_env(), "STALWART_JOB_SECRET": "q" * 32}
        if n == 1:
            env["QUARANTINE_CRASH"] = "1"
        procs[n] = subprocess.Popen(
            stalwart_argv(
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--max-restarts",
                "5",
                "--node-rank",
                str(n),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "--rdzv-id",
                "qstatic",
                "--log-dir",
                tmp_path / f"n{n}",
                WORKER,
                tmp_path,
            ),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    outs = {n: p.communicate(timeout=150)[0] for n, p in procs.items()}
    for n, p in procs.items():
        assert p.returncode == 1, outs[n][-3000:]
    lines = [ln for ln in outs[1].splitlines() if ln.startswith("stalwart: job qstatic stopped")]
    assert lines == [
        "stalwart: job qstatic stopped after attempt 2: node node rank 1 is quarantined for the "
        "rest of the job: implicated in 3 of the last 5 failed rounds (round 2; failed, failed, "
        "failed); a job of fixed membership cannot go on without it (quarantine needs elastic "
        "--nnodes MIN:MAX to go on)"
    ], outs[1][-3000:]
    assert "node node rank 1 is quarantined" in outs[0], outs[0][-3000:]
    for n in (0, 1):
        ev = kinds(events(tmp_path / f"n{n}"))
        assert ev.count("worker_spawn") == 3 and "node_quarantined" in ev, ev
