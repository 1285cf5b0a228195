"""A stranger on the store's port: a single-node job's stores refuse connections that do
not come from loopback, and a malformed record written by a client that can reach the
store is dropped with one log line, without a restart and without a traceback."""

from __future__ import annotations

import ipaddress
import socket
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psutil
import pytest

from tests.helpers import ROOT, STALWART, clean_env, events, kinds, wait_for

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(120)]

WORKER = Path(__file__).parent / "gated_worker.py"


def outside_address() -> str | None:
    """A non-loopback IPv4 address of this machine (what a neighbour would connect to)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return str(a.address)
    return None


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    """A two-worker single-node job, its workers up and waiting for a go file."""
    stderr = tmp_path / "launcher.err"
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(
            [
                *STALWART,
                "run",
                "--nproc-per-node",
                "2",
                "--rdzv-id",
                "stranger",
                "--log-dir",
                str(tmp_path / "logs"),
                str(WORKER),
                str(tmp_path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=clean_env(),
            cwd=ROOT,
        )
    try:
        wait_for(
            lambda: (
                all((tmp_path / f"ready_{r}").exists() for r in range(2)) or proc.poll() is not None
            ),
            60,
            "both workers to start",
        )
        assert proc.poll() is None, stderr.read_text()
        yield proc, tmp_path, stderr
    finally:
        (tmp_path / "go").touch()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def listening_ports(pid: int) -> list[tuple[str, int]]:
    return [
        (str(c.laddr.ip), int(c.laddr.port))
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


def test_single_node_stores_refuse_a_stranger(
    job: tuple[subprocess.Popen[bytes], Path, Path],
) -> None:
    proc, _, _ = job
    outside = outside_address()
    if outside is None:
        pytest.skip("this machine has no non-loopback address to connect from")
    ports = listening_ports(proc.pid)
    # The launcher's rendezvous store and the workers' store.
    assert len(ports) >= 2, ports
    for ip, port in ports:
        assert ipaddress.ip_address(ip).is_loopback, (ip, port)
        with socket.socket() as s:
            s.bind((outside, 0))
            s.settimeout(5)
            with pytest.raises(ConnectionRefusedError):
                s.connect((outside, port))


def test_malformed_failure_record_is_dropped_without_restart(
    job: tuple[subprocess.Popen[bytes], Path, Path],
) -> None:
    from torch.distributed import TCPStore

    proc, out, stderr = job
    stores = [
        TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        for _, port in listening_ports(proc.pid)
    ]
    (rdzv,) = [s for s in stores if s.check(["run_id"])]
    # Valid JSON without the fields a failure has (the launcher used to die on a
    # KeyError), then the flag that tells every node the round failed.
    rdzv.set("r0/failure/0", '{"kind": "worker", "message": "boom"}')
    rdzv.set("r0/failed", "0")
    # The job's records are sealed (a one-node job draws its own secret): the flag
    # without the job's MAC is refused before the record is read.
    refused = "refused the value at rendezvous store key r0/failed"
    wait_for(
        lambda: refused in stderr.read_text(),
        30,
        "the launcher to log the malformed record",
    )
    (out / "go").touch()
    assert proc.wait(timeout=60) == 0, stderr.read_text()
    text = stderr.read_text()
    assert text.count(refused) == 1, text
    assert "Traceback" not in text, text
    evs = kinds(events(out / "logs"))
    assert "restart" not in evs and "peer_failure" not in evs, evs
    assert evs.count("worker_spawn") == 2 and "job_succeeded" in evs, evs
