"""A rank asks to exclude its node: elastic jobs go on without the node, static ones end."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import (
    ROOT,
    clean_env,
    events,
    free_port,
    kinds,
    stalwart_argv,
    wait_for,
    wait_listening,
)

pytestmark = pytest.mark.timeout(180)

WORKER = Path(__file__).parent / "exclude_worker.py"


def _launch(tmp_path: Path, name: str, node_rank: int, args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        stalwart_argv(
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "1",
            "--node-rank",
            str(node_rank),
            "--log-dir",
            tmp_path / name,
            *args,
        ),
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _events(log_dir: Path) -> list[str]:
    return kinds(events(log_dir))


@pytest.mark.parametrize("excluder", [1, 0], ids=["joiner", "store-host"])
def test_elastic_job_goes_on_without_the_excluded_node(tmp_path: Path, excluder: int) -> None:
    port = free_port()
    args = [
        "--nnodes",
        "1:2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "excl",
        "--rdzv-conf",
        "last_call_timeout=30,keep_alive_interval=0.5",
        str(WORKER),
        str(tmp_path),
        str(excluder),
    ]
    first = _launch(tmp_path, "n0", 0, args)
    wait_listening(port, first, "node 0 to host the rendezvous store")
    second = _launch(tmp_path, "n1", 1, args)
    procs = {0: first, 1: second}
    outs = {n: p.communicate(timeout=150)[0] for n, p in procs.items()}
    for n, p in procs.items():
        assert p.returncode == 0, outs[n][-3000:]
    stay = 1 - excluder
    assert "the job goes on with the other nodes" in outs[excluder], outs[excluder][-2000:]
    assert "asked to exclude node" in outs[excluder]
    # The survivor ran attempt 1 alone, as node 0 of a one-worker job.
    assert (tmp_path / "ok_1_0").read_text() == "1"
    assert not (tmp_path / "ok_1_1").exists()
    ev_stay = _events(tmp_path / f"n{stay}")
    assert "node_excluded" in ev_stay and "job_succeeded" in ev_stay, ev_stay
    assert ev_stay.count("worker_spawn") == 2, ev_stay
    ev_out = _events(tmp_path / f"n{excluder}")
    assert "node_excluded" in ev_out and ev_out.count("worker_spawn") == 1, ev_out


def test_excluded_store_host_stops_serving_on_a_signal(tmp_path: Path) -> None:
    import signal

    port = free_port()
    (tmp_path / "hold").touch()
    args = [
        "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "exsig", "--rdzv-conf", "last_call_timeout=30,keep_alive_interval=0.5",
        str(WORKER), str(tmp_path), "0",
    ]  # fmt: skip
    log = tmp_path / "host.log"
    with open(log, "wb") as fh:
        host = subprocess.Popen(
            stalwart_argv("--nproc-per-node", "1",
             "--max-restarts", "1", "--node-rank", "0", "--log-dir", tmp_path / "n0", *args),
            cwd=ROOT, env=clean_env(), stdout=fh, stderr=subprocess.STDOUT,
        )  # fmt: skip
    other = None
    try:
        wait_listening(port, host, "node 0 to host the rendezvous store")
        other = _launch(tmp_path, "n1", 1, args)

        def serving() -> bool:
            if "serving it until the job ends" in log.read_text():
                return True
            assert host.poll() is None, log.read_text()[-3000:]
            return False

        wait_for(serving, 90, "the excluded host to keep serving the store", interval=0.05)
        # The host serves the store for the other node, which runs attempt 1 meanwhile.
        host.send_signal(signal.SIGTERM)
        host.wait(timeout=15)
        out = log.read_text()
        assert host.returncode == 0 and "Traceback" not in out, out[-3000:]
    finally:
        (tmp_path / "go").touch()
        for p in (host, other):
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.communicate(timeout=30)


def test_static_job_ends_with_the_reason(tmp_path: Path) -> None:
    port = str(free_port())
    args = [
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--rdzv-id",
        "exstatic",
        str(WORKER),
        str(tmp_path),
        "1",
    ]
    procs = {n: _launch(tmp_path, f"n{n}", n, args) for n in (0, 1)}
    outs = {n: p.communicate(timeout=150)[0] for n, p in procs.items()}
    for n, p in procs.items():
        assert p.returncode == 1, outs[n][-3000:]
    # One line says why the job stopped (the end-of-job summary block follows it).
    lines = [
        ln for ln in outs[1].splitlines() if ln.startswith("stalwart: job") and "stopped" in ln
    ]
    assert len(lines) == 1, outs[1][-3000:]
    assert "asked to exclude node 1" in lines[0] and "fixed membership" in lines[0], lines
    assert "asked to exclude node 1" in outs[0], outs[0][-3000:]
    for n in (0, 1):
        ev = _events(tmp_path / f"n{n}")
        assert "job_stopped" in ev and "restart" not in ev, ev
