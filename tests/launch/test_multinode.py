"""Two launchers on this machine form one job through node 0's store (static rendezvous)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import events, free_port, stalwart, start_stalwart, warm_and_cold

from .helpers import SCRIPTS

# Only the job that runs workers needs both start paths: the others end in the
# rendezvous, before any worker (warm, the default, also has a template to tear down).
pytestmark = pytest.mark.timeout(180)


@warm_and_cold
def test_two_nodes_restart_together_with_job_wide_count(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port = str(free_port())
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--rdzv-id",
        "job42",
    ]
    node1 = start_stalwart(
        *common,
        "--node-rank",
        "1",
        "--log-dir",
        tmp_path / "n1",
        SCRIPTS / "gloo_restart.py",
        "2",
        out,
    )
    node0 = stalwart(
        *common,
        "--node-rank",
        "0",
        "--log-dir",
        tmp_path / "n0",
        SCRIPTS / "gloo_restart.py",
        "2",
        out,
        timeout=150,
    )
    node1.wait(60)
    assert node0.returncode == 0, node0.stderr[-2000:]
    assert node1.returncode == 0, node1.stderr.read()[-2000:] if node1.stderr else ""
    for attempt in range(3):
        for rank in (0, 1):
            assert (out / f"ok_{attempt}_{rank}").read_text() == str(attempt)
    ev0, ev1 = events(tmp_path / "n0"), events(tmp_path / "n1")
    # Attempt 0: rank 0 (node 0) failed, node 1 followed; attempt 1: the other way round.
    r0 = [e["event"] for e in ev0 if e["event"] in ("restart", "peer_failure")]
    r1 = [e["event"] for e in ev1 if e["event"] in ("restart", "peer_failure")]
    # The node whose rank did not fail has its own rank die of the broken barrier within
    # milliseconds of the peer's exit, so its launcher may see that before the peer's
    # failure in the store (then no peer_failure event): node 1 in attempt 0, node 0 in
    # attempt 1. Either way each node restarts exactly twice, together.
    assert r0 in (["restart", "peer_failure", "restart"], ["restart", "restart"]), r0
    assert r1 in (["peer_failure", "restart", "restart"], ["restart", "restart"]), r1
    spawns = [e for e in ev1 if e["event"] == "worker_spawn"]
    assert [s["rank"] for s in spawns] == [1, 1, 1] and ev1[0]["node_rank"] == 1


def test_mismatched_job_id_is_a_clear_error(tmp_path: Path) -> None:
    port = str(free_port())
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
    ]
    host = start_stalwart(
        *common,
        "--node-rank",
        "0",
        "--rdzv-id",
        "alpha",
        "--log-dir",
        tmp_path / "a",
        SCRIPTS / "steps.py",
        tmp_path,
    )
    try:
        other = stalwart(
            *common,
            "--node-rank",
            "1",
            "--rdzv-id",
            "beta",
            "--rdzv-conf",
            "join_timeout=20",
            "--log-dir",
            tmp_path / "b",
            SCRIPTS / "steps.py",
            tmp_path,
        )
        assert other.returncode == 3
        assert "rendezvous id mismatch" in other.stderr and "'beta'" in other.stderr
    finally:
        host.kill()
        host.wait()


def test_joiner_never_claims_the_job_id(tmp_path: Path) -> None:
    """A joiner that reaches the store before its host has published the job id waits
    for it: claiming the empty store made the real host reject its own job (seen in CI).
    """
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    proc = stalwart(
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(store.port),
        "--rdzv-id",
        "beta",
        "--rdzv-conf",
        "join_timeout=3",
        "--log-dir",
        tmp_path,
        SCRIPTS / "steps.py",
        tmp_path,
    )
    assert proc.returncode == 3, proc.stderr
    assert "waiting for the host to publish the job's rendezvous id" in proc.stderr
    assert not store.check(["run_id"])
    assert store.num_keys() <= 1  # nothing but torch's own init key: the joiner wrote nothing


def test_unreachable_endpoint_is_a_clear_error(tmp_path: Path) -> None:
    proc = stalwart(
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "--rdzv-conf",
        "join_timeout=2",
        "--log-dir",
        tmp_path,
        SCRIPTS / "steps.py",
        tmp_path,
    )
    assert proc.returncode == 3
    assert "cannot reach the rendezvous store at 127.0.0.1:" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
