"""Multi-node jobs on simulated hosts (network namespaces): elastic membership over c10d
and etcd, node loss by SIGKILL and by a cut link, spare nodes, and the store's host lost.

Every job is the real gloo DDP job in ``elastic_train.py``; its final model is compared
with a one-process reference, so a job that "survived" by skipping or repeating steps
fails the test.
"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bench import elastic_train
from bench.netns import TRAIN, Etcd, Host, Network, rdzv_args
from tests.helpers import clean_env, free_port, read_events, stalwart_argv, wait_for

pytestmark = pytest.mark.timeout(240)

STEPS = 60
FAST = (
    "keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=3,"
    "join_timeout=40,close_timeout=5"
)


def launch(
    host: Host,
    out: Path,
    *,
    backend: str,
    endpoint: str,
    nnodes: str,
    name: str,
    max_restarts: int = 3,
    run_id: str = "job",
    step_s: float = 0.05,
) -> subprocess.Popen[str]:
    return host.stalwart(
        *rdzv_args(
            backend=backend,
            endpoint=endpoint,
            nnodes=nnodes,
            run_id=run_id,
            conf=FAST,
            max_restarts=max_restarts,
        ),
        "--shutdown-timeout",
        "3",
        "--log-dir",
        out / f"logs-{name}",
        TRAIN,
        str(STEPS),
        out,
        "--step-s",
        str(step_s),
        # Every test acts on the first attempt only: the restarted job runs unpaced.
        "--later-step-s",
        "0",
        log=out / f"{name}.out",
    )


def wait_for_step(
    out: Path, step: int, procs: list[subprocess.Popen[str]], timeout: float = 90
) -> None:

    def reached() -> bool:
        try:
            _, got = (out / "progress").read_text().split()
            if int(got) >= step:
                return True
        except (FileNotFoundError, ValueError):
            pass
        for p in procs:
            assert p.poll() is None, f"a launcher exited early ({p.returncode})"
        return False

    wait_for(reached, timeout, f"the job to reach step {step}", interval=0.05)


def wait_while_alive(
    cond: Callable[[], bool], proc: subprocess.Popen[str], out: Path, name: str, what: str
) -> None:
    """Until ``cond()``; host ``name``'s launcher exiting first fails with its output."""

    def done() -> bool:
        if cond():
            return True
        assert proc.poll() is None, text(out, name)[-2000:]
        return False

    wait_for(done, 60, what, interval=0.05)


def attempts(out: Path) -> list[dict[str, int | str]]:
    return [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]


@functools.cache
def reference_state(steps: int) -> dict[str, torch.Tensor]:
    """The one-process reference after ``steps`` steps: the same for every job of that
    length, so computed once, here (this process's random state is left as it was)."""
    with torch.random.fork_rng():
        return elastic_train.reference_state(steps)


def assert_matches_reference(out: Path, steps: int = STEPS) -> None:
    """The job's final model is the one-process reference's after ``steps`` steps."""
    got, want = torch.load(out / "final.pt"), reference_state(steps)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)


@pytest.fixture(params=["c10d", "etcd"])
def store(request: pytest.FixtureRequest, network: Network) -> tuple[str, str | None]:
    """(backend, endpoint): etcd runs outside the simulated hosts; c10d's endpoint is
    node a's address, known once the test has made its hosts (None here)."""
    if request.param == "etcd":
        server: Etcd = request.getfixturevalue("etcd")
        return "etcd", server.endpoint
    return "c10d", None


def endpoint_for(store: tuple[str, str | None], first: Host) -> dict[str, str]:
    backend, endpoint = store
    return {"backend": backend, "endpoint": endpoint or f"{first.addr}:{free_port()}"}


def text(out: Path, name: str) -> str:
    return (out / f"{name}.out").read_text()


def events(out: Path, name: str) -> list[dict[str, object]]:
    files = list((out / f"logs-{name}").glob("*/events.jsonl"))
    return [e for f in files for e in read_events(f)]


def test_two_nodes_then_one_killed(
    network: Network, store: tuple[str, str | None], tmp_path: Path
) -> None:
    """Normal 2-node start; node b's launcher SIGKILLed mid-run; node a finishes alone
    (MIN=1) from the last checkpoint with the reference model."""
    a, b = network.add_host(), network.add_host()
    kw = endpoint_for(store, a)
    pa = launch(a, tmp_path, nnodes="1:2", name="a", **kw)
    pb = launch(b, tmp_path, nnodes="1:2", name="b", **kw)
    wait_for_step(tmp_path, 15, [pa, pb])
    pb.send_signal(signal.SIGKILL)
    assert pa.wait(120) == 0, text(tmp_path, "a")[-3000:]
    assert_matches_reference(tmp_path)
    runs = attempts(tmp_path)
    first = [r for r in runs if r["attempt"] == 0]
    assert sorted(r["world"] for r in first) == [2, 2]
    assert len({r["host_addr"] for r in first}) == 1  # one MASTER_ADDR on every node
    later = [r for r in runs if r["attempt"] != 0]
    assert later and all(r["world"] == 1 for r in later) and later[0]["start"] > 0
    ev = events(tmp_path, "a")
    assert any(e["event"] == "nodes_left" for e in ev), ev


def test_cut_link_is_detected_by_both_sides(
    network: Network, store: tuple[str, str | None], tmp_path: Path
) -> None:
    """The cable of node 1 is pulled: node 0 notices the missing keep-alive and goes on
    alone; node 1 notices it cannot reach the store and stops its workers with a clear
    error instead of training on by itself."""
    a, b = network.add_host(), network.add_host()
    kw = endpoint_for(store, a)
    pa = launch(a, tmp_path, nnodes="1:2", name="a", **kw)
    pb = launch(b, tmp_path, nnodes="1:2", name="b", **kw)
    wait_for_step(tmp_path, 15, [pa, pb])
    b.cut()
    assert pa.wait(120) == 0, text(tmp_path, "a")[-3000:]
    assert pb.wait(60) == 3, text(tmp_path, "b")[-3000:]
    assert "stalwart run: error:" in text(tmp_path, "b")
    assert_matches_reference(tmp_path)
    ev = events(tmp_path, "a")
    reasons = [str(e.get("reason")) for e in ev if e["event"] == "node_lost"]
    assert any("no keep-alive" in r for r in reasons), ev


def test_spare_node_is_used_after_a_fault(
    network: Network, store: tuple[str, str | None], tmp_path: Path
) -> None:
    """Nodes 0 and 1 run (MAX=2); node 2 joins mid-run and waits as a spare; when node 1
    is killed, the spare takes its place at the restart and the job ends at world 2."""
    a, b, c = network.add_host(), network.add_host(), network.add_host()
    kw = endpoint_for(store, a)
    # Slow steps: the job must still run once the spare's launcher is up (a few seconds).
    pa = launch(a, tmp_path, nnodes="1:2", name="a", step_s=0.25, **kw)
    pb = launch(b, tmp_path, nnodes="1:2", name="b", step_s=0.25, **kw)
    wait_for_step(tmp_path, 3, [pa, pb])
    pc = launch(c, tmp_path, nnodes="1:2", name="c", step_s=0.25, **kw)
    # The spare registers for the next round without disturbing the running one.
    wait_while_alive(
        lambda: "waiting as a spare" in text(tmp_path, "c"), pc, tmp_path, "c", "the spare"
    )
    # ... and keeps waiting for longer than last_call_timeout (3 s = 12 steps of 0.25 s):
    # the next round must still wait for the survivors, not start with the spare alone.
    step_now = int((tmp_path / "progress").read_text().split()[1])
    wait_for_step(tmp_path, step_now + 14, [pa, pb, pc])
    assert all(r["attempt"] == 0 for r in attempts(tmp_path))
    assert int((tmp_path / "progress").read_text().split()[1]) < STEPS - 10
    pb.send_signal(signal.SIGKILL)
    assert pa.wait(120) == 0, text(tmp_path, "a")[-3000:]
    assert pc.wait(60) == 0, text(tmp_path, "c")[-3000:]
    assert_matches_reference(tmp_path)
    later = [r for r in attempts(tmp_path) if r["attempt"] != 0]
    assert later and all(r["world"] == 2 for r in later), later
    # Survivor keeps group rank 0; the spare comes after it.
    spare = [e for e in events(tmp_path, "c") if e["event"] == "rendezvous_done"]
    assert spare and spare[0]["group_rank"] == 1 and spare[0]["attempt"] >= 1


def test_losing_the_c10d_store_host_fails_clearly(network: Network, tmp_path: Path) -> None:
    """With c10d the store's host is a single point of failure: node 1 must stop with a
    one-line error naming the store, not hang."""
    a, b = network.add_host(), network.add_host()
    endpoint = f"{a.addr}:{free_port()}"
    pa = launch(a, tmp_path, backend="c10d", endpoint=endpoint, nnodes="1:2", name="a")
    pb = launch(b, tmp_path, backend="c10d", endpoint=endpoint, nnodes="1:2", name="b")
    wait_for_step(tmp_path, 10, [pa, pb])
    pa.send_signal(signal.SIGKILL)
    assert pb.wait(60) == 3, text(tmp_path, "b")[-3000:]
    err = [line for line in text(tmp_path, "b").splitlines() if "stalwart run: error:" in line]
    assert err and "rendezvous store" in err[0] and "single point of failure" in err[0], err
    ev = events(tmp_path, "b")
    assert any(e["event"] == "rendezvous_error" for e in ev), ev
    assert [e["exit_code"] for e in ev if e["event"] == "launcher_exit"] == [3]


def test_etcd_job_survives_losing_any_launcher(
    network: Network, etcd: Etcd, tmp_path: Path
) -> None:
    """Over etcd no launcher holds the rendezvous: killing node 0 (which also hosted the
    workers' store) leaves node 1 to finish the job with the reference model."""
    a, b = network.add_host(), network.add_host()
    pa = launch(a, tmp_path, backend="etcd", endpoint=etcd.endpoint, nnodes="1:2", name="a")
    pb = launch(b, tmp_path, backend="etcd", endpoint=etcd.endpoint, nnodes="1:2", name="b")
    wait_for_step(tmp_path, 15, [pa, pb])
    first = attempts(tmp_path)
    node0 = next(r for r in first if r["group_rank"] == 0)
    victim, survivor, name = (pa, pb, "b") if node0["host_addr"] == a.addr else (pb, pa, "a")
    victim.send_signal(signal.SIGKILL)
    assert survivor.wait(120) == 0, text(tmp_path, name)[-3000:]
    assert_matches_reference(tmp_path)
    later = [r for r in attempts(tmp_path) if r["attempt"] != 0]
    assert later and all(r["world"] == 1 for r in later)
    assert later[0]["host_addr"] != node0["host_addr"]  # a new node 0 hosts the workers' store


def test_etcd_unreachable_is_a_clear_error(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = subprocess.run(
        stalwart_argv(
            "--nnodes",
            "2",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            "--rdzv-conf",
            "join_timeout=2",
            "--rdzv-id",
            "x",
            TRAIN,
            "1",
            tmp_path,
        ),
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot reach etcd at 127.0.0.1:" in lines[0], proc.stderr
    assert time.monotonic() - t0 < 30


def test_below_min_waits_for_a_replacement(network: Network, tmp_path: Path) -> None:
    """MIN=2: after node b is lost the survivor may not go on alone; it waits in the
    rendezvous until a replacement host arrives, then the job finishes at world 2."""
    a, b, c = network.add_host(), network.add_host(), network.add_host()
    kw = {"backend": "c10d", "endpoint": f"{a.addr}:{free_port()}", "nnodes": "2:2"}
    pa = launch(a, tmp_path, name="a", **kw)
    pb = launch(b, tmp_path, name="b", **kw)
    wait_for_step(tmp_path, 15, [pa, pb])
    pb.send_signal(signal.SIGKILL)
    pb.wait()
    # The survivor notices, stops its worker and waits for a second node.
    wait_while_alive(
        lambda: any(e["event"] == "restart" for e in events(tmp_path, "a")),
        pa, tmp_path, "a", "the survivor's restart",
    )  # fmt: skip
    pc = launch(c, tmp_path, name="c", **kw)
    assert pa.wait(120) == 0, text(tmp_path, "a")[-3000:]
    assert pc.wait(60) == 0, text(tmp_path, "c")[-3000:]
    assert_matches_reference(tmp_path)
    later = [r for r in attempts(tmp_path) if r["attempt"] != 0]
    assert later and all(r["world"] == 2 for r in later), later
