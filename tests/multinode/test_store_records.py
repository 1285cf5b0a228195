"""Decisions about stores as tables: where a store listens, which records are dropped,
what a rank's control request does to the round."""

from __future__ import annotations

import logging
from datetime import timedelta

import msgspec
import pytest
from torch.distributed import TCPStore

from stalwart.launch.round.decide import Asked, RoundOutcome, control_outcome
from stalwart.rendezvous.api import (
    FailureRecord,
    NodeExcluded,
    NodeLost,
    ShutdownRequested,
    WorkerFailed,
    decode_failure,
)
from stalwart.rendezvous.kv import C10dKV, bind_address, host_store, read_failures


@pytest.mark.parametrize(
    ("host", "resolved", "want"),
    [
        ("127.0.0.1", ["127.0.0.1"], "127.0.0.1"),
        ("localhost", ["127.0.0.1", "::1"], "127.0.0.1"),
        ("10.1.2.3", ["10.1.2.3"], "10.1.2.3"),
        ("node7", ["10.1.2.7"], "10.1.2.7"),
        # Debian maps the machine's own name to 127.0.1.1: peers use another address.
        ("node7", ["127.0.1.1"], ""),
        ("fe80::1", ["fe80::1"], "fe80::1"),
        ("unresolvable", [], ""),
    ],
)
def test_bind_address(host: str, resolved: list[str], want: str) -> None:
    assert bind_address(host, resolved) == want


@pytest.mark.parametrize(
    ("action", "elastic", "want"),
    [
        (Asked.SHUTDOWN_WORKLOAD, False, RoundOutcome.SHUTDOWN_REQUESTED),
        (Asked.SHUTDOWN_WORKLOAD, True, RoundOutcome.SHUTDOWN_REQUESTED),
        (Asked.EXCLUDE_NODE, False, RoundOutcome.SHUTDOWN_REQUESTED),
        (Asked.EXCLUDE_NODE, True, RoundOutcome.NODE_EXCLUDED),
        (Asked.CONTINUE, True, None),
    ],
)
def test_control_outcome(action: Asked, elastic: bool, want: RoundOutcome | None) -> None:
    assert control_outcome(action, elastic) is want


def test_host_store_listens_on_loopback_only() -> None:
    store = host_store("127.0.0.1", 0, 10)
    client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v"


GOOD = '{"kind": "worker", "local_rank": 0, "node_rank": 1, "pid": 7, "exitcode": 1}'


@pytest.mark.parametrize(
    ("raw", "kept"),
    [
        (GOOD, True),
        ('{"kind": "node_lost", "local_rank": -1, "node_rank": 1, "reason": "gone"}', True),
        ("{not json", False),
        ("[1, 2]", False),
        ('{"kind": "node_lost", "node_rank": 1, "reason": "gone"}', True),
        ('{"kind": "shutdown", "node_rank": 1, "pid": 9, "reason": "asked"}', True),
        ('{"kind": "exclude_node", "node_rank": 1, "reason": "asked"}', True),
        ('{"kind": "worker", "message": "no ranks"}', False),
        ('{"kind": "worker", "node_rank": 1}', False),  # a worker record names the worker
        ('{"kind": "reboot", "local_rank": 0, "node_rank": 1}', False),
        ('{"local_rank": 0, "node_rank": 1}', False),  # no kind: no type to read it as
        ('{"kind": "worker", "local_rank": "0", "node_rank": 1}', False),
        ('{"kind": "worker", "local_rank": -5, "node_rank": 1}', False),
        ('{"kind": "worker", "local_rank": -1, "node_rank": 1}', False),
        ('{"kind": "node_lost", "node_rank": -1}', False),
        ('{"kind": "worker", "local_rank": 0, "node_rank": 9}', False),  # not of this round
        ('{"local_rank": "0", "node_rank": 1}', False),
        ('{"local_rank": -5, "node_rank": 1}', False),
        ('{"local_rank": 0, "node_rank": 9}', False),
    ],
)
def test_read_failures_drops_malformed_records_once(
    raw: str, kept: bool, caplog: pytest.LogCaptureFixture
) -> None:
    kv = C10dKV("127.0.0.1", 0, is_host=True, connect_timeout=10, op_timeout=10)
    kv.set("r0/failure/1", raw)
    warned: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="stalwart.rendezvous.kv"):
        for _ in range(3):
            got = read_failures(kv, 0, 2, warned)
            assert len(got) == (1 if kept else 0)
    drops = [r for r in caplog.records if "malformed failure record" in r.getMessage()]
    assert len(drops) == (0 if kept else 1)


@pytest.mark.parametrize(
    "rec",
    [
        WorkerFailed(node_rank=1, local_rank=2, rank=6, pid=7, exitcode=-9, signal="SIGKILL"),
        NodeLost(node_rank=3, host="h3", reason="node 3 (h3) lost: no keep-alive for 9.0s"),
        ShutdownRequested(node_rank=0, host="h0", pid=11, reason="rank 0 asked"),
        NodeExcluded(node_rank=2, host="h2", pid=12, reason="rank 5 asked"),
    ],
)
def test_failure_records_cross_the_store_as_tagged_json(rec: FailureRecord) -> None:
    raw = rec.encode()
    kind = {
        WorkerFailed: "worker",
        NodeLost: "node_lost",
        ShutdownRequested: "shutdown",
        NodeExcluded: "exclude_node",
    }[type(rec)]
    assert msgspec.json.decode(raw)["kind"] == kind
    assert decode_failure(raw) == rec


def test_host_store_for_peers_listens_on_the_advertised_address_only() -> None:
    """A multi-node store: reachable at the address peers use, not on loopback (nor on
    any other interface)."""
    import ipaddress
    import socket

    import psutil

    outside = next(
        (
            a.address
            for addrs in psutil.net_if_addrs().values()
            for a in addrs
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback
        ),
        None,
    )
    if outside is None:
        pytest.skip("this machine has no non-loopback address")
    store = host_store(outside, 0, 10)
    client = TCPStore(outside, store.port, is_master=False, timeout=timedelta(seconds=5))
    client.set("k", "v")
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", store.port))
