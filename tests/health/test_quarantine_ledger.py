"""The quarantine ledger in a real TCPStore, against a stranger who reaches its port:
forged, replayed, foreign, garbage and oversized values are dropped, and cannot
quarantine a healthy node."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import msgspec
import pytest
from torch.distributed import TCPStore

from stalwart.base.events import Event
from stalwart.config import ConfigError
from stalwart.config.values import parse_quarantine_after, parse_quarantine_for
from stalwart.health.guard import QuarantineGuard
from stalwart.health.ledger import ENTRY_LIMIT, Ledger, ledger_key, seal
from stalwart.health.quarantine import Cause, Implication, Policy
from stalwart.rendezvous import keys
from stalwart.rendezvous.api import WorkerFailed
from stalwart.rendezvous.kv import C10dKV

pytestmark = pytest.mark.timeout(60)

SECRET = b"s" * 32
KEY = ledger_key(SECRET, "job")
NODES = ("a@10.0.0.1", "b@10.0.0.2", "c@10.0.0.3")


@pytest.fixture
def stranger(kv: C10dKV) -> TCPStore:
    """Anyone who reaches the store's port: no secret, raw keys."""
    return TCPStore("127.0.0.1", kv.port, is_master=False, timeout=timedelta(seconds=5))


class Node:
    """This node's side of the rendezvous, as the guard uses it."""

    elastic = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.withdrawn = False

    def node_names(self, round_: int) -> tuple[str, ...]:
        return NODES

    def withdraw(self) -> int:
        self.withdrawn = True
        return 2


def _entry(r: int, node: str = NODES[1], **kw: Any) -> Implication:
    return Implication(round=r, node=node, cause=Cause.FAILED, nodes=3, at=1000.0 + r, **kw)


def _forge(stranger: TCPStore, r: int, rank: int, raw: bytes) -> None:
    stranger.set(keys.Round(r).implicated(rank), raw)


def _guard(kv: C10dKV, emitted: list[tuple[Event, dict[str, Any]]]) -> QuarantineGuard:
    def emit(ev: Event, **fields: Any) -> None:
        emitted.append((ev, fields))

    return QuarantineGuard(
        Ledger(kv, KEY, max_nodes=3), Policy(3, 5, None), emit, min_nodes=2, clock=lambda: 2000.0
    )


def test_a_stranger_cannot_quarantine_a_healthy_node(
    kv: C10dKV, stranger: TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    other_job = ledger_key(SECRET, "another-job")
    for r in range(3):
        forged = msgspec.json.decode(seal(KEY, _entry(r, NODES[2])))
        # An entry naming b under c's MAC: a forgery of the node field.
        forged["entry"]["node"] = NODES[1]
        _forge(stranger, r, 0, msgspec.json.encode(forged))
        _forge(stranger, r, 1, seal(other_job, _entry(r)))  # another job's key
        _forge(stranger, r, 2, seal(b"x" * 32, _entry(r)))  # a guessed secret
    emitted: list[tuple[Event, dict[str, Any]]] = []
    node = Node(NODES[1])
    with caplog.at_level(logging.WARNING, logger="stalwart.health.ledger"):
        assert _guard(kv, emitted).check(node, 3) is None  # type: ignore[arg-type]
    assert emitted == [] and not node.withdrawn
    drops = [r.getMessage() for r in caplog.records]
    assert len(drops) == 9 and all("MAC does not match" in d for d in drops), drops


def test_a_replayed_entry_of_another_round_is_dropped(kv: C10dKV, stranger: TCPStore) -> None:
    ledger = Ledger(kv, KEY, max_nodes=3)
    ledger.write(0, _entry(0))
    real = kv.get(keys.Round(0).implicated(0))
    assert real is not None
    for r in (1, 2):
        _forge(stranger, r, 0, real)
    assert [e.round for e in Ledger(kv, KEY, max_nodes=3).read(3)] == [0]


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xfe not json",
        b"[]",
        b'{"entry": {"round": 0}, "mac": ""}',
        b'{"entry": {"round": -1, "node": "b", "cause": "failed", "nodes": 3, "at": 1}, "mac": "0"}',
        b"{" * 100_000,
        # A real entry (the stranger read it) padded past the limit: only the size stops it.
        seal(KEY, Implication(round=0, node="c@10.0.0.3", cause=Cause.FAILED, nodes=3, at=1000.0))
        + b" " * ENTRY_LIMIT,
    ],
    ids=["binary", "list", "partial", "negative", "deep", "oversized"],
)
def test_hostile_values_are_dropped_and_the_node_behind_them_is_read(
    kv: C10dKV, stranger: TCPStore, raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    _forge(stranger, 0, 0, raw)
    Ledger(kv, KEY, max_nodes=3).write(1, _entry(0, NODES[2]))
    with caplog.at_level(logging.WARNING, logger="stalwart.health.ledger"):
        got = Ledger(kv, KEY, max_nodes=3).read(1)
    assert [e.node for e in got] == [NODES[2]]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("quarantine ledger: dropped the value at r0/implicated/0: ")
    assert "\n" not in line and len(line) < 400, line


def test_oversized_fields_of_a_signed_entry_are_refused(kv: C10dKV) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(
            msgspec.json.encode(
                {"round": 0, "node": "n" * 301, "cause": "failed", "nodes": 2, "at": 1}
            ),
            type=Implication,
        )


def test_the_nodes_of_the_job_quarantine_the_root_cause_node(kv: C10dKV) -> None:
    """Three rounds whose root cause is on node b, written by every node: b withdraws,
    the others announce it once and go on."""
    rounds = [[WorkerFailed(node_rank=1, local_rank=0, rank=1, exitcode=7, timestamp=1.0)]] * 3
    guards: dict[str, tuple[QuarantineGuard, list[tuple[Event, dict[str, Any]]]]] = {}
    for name in NODES:
        out: list[tuple[Event, dict[str, Any]]] = []
        guards[name] = (_guard(kv, out), out)
    fresh = []
    for r, records in enumerate(rounds):
        for rank, name in enumerate(NODES):
            fresh.append(guards[name][0].record(Node(name), r, rank, records))  # type: ignore[arg-type]
    assert [len(f) for f in fresh] == [0] * 6 + [1] * 3
    b, a = Node(NODES[1]), Node(NODES[0])
    kept = guards[b.name][0].check(b, 3)  # type: ignore[arg-type]
    assert kept is not None and kept.withdrawal.goes_on and b.withdrawn
    assert guards[a.name][0].check(a, 3) is None and not a.withdrawn  # type: ignore[arg-type]
    assert guards[a.name][0].check(a, 3) is None  # type: ignore[arg-type]
    # b's launcher started again (it has not run a round): still kept out.
    again = Node(NODES[1])
    assert _guard(kv, []).check(again, 0) is not None and again.withdrawn  # type: ignore[arg-type]
    fresh_a = Node(NODES[0])
    assert _guard(kv, []).check(fresh_a, 0) is None and not fresh_a.withdrawn  # type: ignore[arg-type]
    (ev,) = guards[a.name][1]
    assert ev[0] is Event.NODE_QUARANTINED and ev[1]["node"] == NODES[1]
    assert ev[1]["causes"] == ["failed"] * 3 and ev[1]["since_attempt"] == 2


@pytest.mark.parametrize(
    ("text", "value"), [("3/5", (3, 5)), ("1/1", (1, 1)), ("off", None), ("OFF", None)]
)
def test_quarantine_after_parses(text: str, value: tuple[int, int] | None) -> None:
    assert parse_quarantine_after(text) == value


@pytest.mark.parametrize("text", ["3", "5/3", "0/5", "a/b", "3/5/7", "3/100000", ""])
def test_quarantine_after_refuses_in_one_line(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^--quarantine-after .*expected K/M") as err:
        parse_quarantine_after(text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("text", "value"), [("never", None), ("600", 600.0), ("0.5", 0.5)])
def test_quarantine_for_parses(text: str, value: float | None) -> None:
    assert parse_quarantine_for(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "1e99", "soon"])
def test_quarantine_for_refuses_in_one_line(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^--quarantine-for .*expected seconds > 0"):
        parse_quarantine_for(text)
