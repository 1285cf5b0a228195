"""The admission gate over a store a stranger can write: signed reports and verdicts,
bounded reads. The nodes are gates in this process sharing an in-memory store (the
rendezvous' own test engine); their probe servers and checks are real."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from stalwart.base.events import Event
from stalwart.health.admission import HealthGate, HealthSettings
from stalwart.health.guard import QuarantineGuard
from stalwart.health.ledger import Ledger, ledger_key, seal
from stalwart.health.quarantine import Cause, Implication, Policy
from stalwart.health.records import (
    RECORD_LIMIT,
    By,
    Exclusion,
    NodeReport,
    Verdict,
    checked_count,
    health_key,
    report_key,
    sign,
    verdict_key,
)
from stalwart.rendezvous import keys
from stalwart.rendezvous.kv import MemoryKV, MemoryStore
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(60)

SECRET = secrets.token_bytes(32)
KEY = health_key(SECRET, "job")


class Node:
    def __init__(self, store: MemoryStore, name: str, **kw: Any) -> None:
        self.name = name
        self.kv = MemoryKV(store)
        self.events: list[tuple[Event, dict[str, Any]]] = []
        self.gate = HealthGate(
            HealthSettings(**kw), KEY, "job", lambda ev, **f: self.events.append((ev, f))
        )

    def check(self, round_: int = 0, peers: tuple[str, ...] = ()) -> None:
        self.gate.before_join(self.kv, round_, self.name, "127.0.0.1", list(peers))


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[Node]]:
    """Three checked nodes, made once: each test puts back what it forged."""
    made = [Node(MemoryStore(), f"n{i}") for i in range(3)]
    made[1].kv, made[2].kv = MemoryKV(made[0].kv._store), MemoryKV(made[0].kv._store)  # type: ignore[attr-defined]
    for n in made:
        n.check()
    yield made
    for n in made:
        n.gate.close()


def stranger(store: MemoryStore) -> MemoryKV:
    return MemoryKV(store, "stranger")


def test_healthy_nodes_pass_and_every_link_is_timed(nodes: list[Node]) -> None:
    ids = [n.name for n in nodes]
    assert nodes[0].gate.refused(nodes[0].kv, 0, ids) == {}
    raw = nodes[2].kv.get(report_key(0, "n2"))
    assert raw is not None
    body = msgspec.json.decode(msgspec.json.decode(raw)["body"], type=NodeReport)
    assert sorted(lk.peer for lk in body.links) == ["n0", "n1"]
    assert all(lk.seconds is not None for lk in body.links)
    (ev, f), *_ = nodes[2].events
    assert ev is Event.HEALTH_CHECKED and f["links"] == 2 and f["problems"] == []


def test_a_node_with_a_problem_is_refused_and_every_node_records_it(store: MemoryStore) -> None:
    good = Node(store, "n0", measure=False)
    bad = Node(store, "n1", measure=False, command='echo \'{"reason": "GPU 3 clock low"}\'; exit 4')
    good.check()
    bad.check()
    ids = ["n0", "n1"]
    why = good.gate.refused(good.kv, 0, ids)
    assert list(why) == ["n1"] and "GPU 3 clock low" in why["n1"]
    good.gate.closing(good.kv, 0, ids)
    assert good.gate.closed(good.kv, 0, "n0") is None
    assert "GPU 3 clock low" in (bad.gate.closed(bad.kv, 0, "n1") or "")
    for node, mine in ((good, False), (bad, True)):
        (f,) = [f for ev, f in node.events if ev is Event.NODE_EXCLUDED]
        assert f["node"] == "n1" and f["this_node"] is mine and f["by"] == "health_check"
    # Announced once per round, however often it is read.
    good.gate.closed(good.kv, 0, "n0")
    assert [ev for ev, _ in good.events].count(Event.NODE_EXCLUDED) == 1


def _failing(node: str, round_: int = 0, run_id: str = "job") -> NodeReport:
    return NodeReport(run_id=run_id, round=round_, node=node, host="h", problems=("forged",))


@pytest.mark.parametrize(
    "forge",
    [
        # Unsigned, or signed with a key that is not the job's.
        lambda: msgspec.json.encode(_failing("n1")).decode(),
        lambda: sign(health_key(b"x" * 32, "job"), _failing("n1")),
        # The right secret for another job (same secret, other run id).
        lambda: sign(health_key(SECRET, "other"), _failing("n1", run_id="other")),
        # A genuine report of another node, or of another round, replayed under n1's key.
        lambda: sign(KEY, _failing("n2")),
        lambda: sign(KEY, _failing("n1", round_=7)),
        # A verdict's signature on a report body.
        lambda: sign(KEY, Verdict(run_id="job", round=0)).replace("verdict", "report"),
        # Signed with the job's key but oversized (read no further than the limit).
        lambda: sign(KEY, _failing("n1")) + " " * RECORD_LIMIT,
        # Garbage.
        lambda: "x" * (RECORD_LIMIT + 1),
        lambda: '{"body": 5, "mac": []}',
        lambda: "\udcff".encode("utf-8", "surrogatepass").decode("latin-1"),
    ],
)
def test_a_stranger_cannot_exclude_a_healthy_node(nodes: list[Node], forge: Any) -> None:
    kv = stranger(nodes[0].kv._store)  # type: ignore[attr-defined]
    genuine = kv.get(report_key(0, "n1"))
    assert genuine is not None
    kv.set(report_key(0, "n1"), forge())
    try:
        # A reader that has not read the round yet (a gate keeps a complete round's reports).
        reader = HealthGate(HealthSettings(), KEY, "job")
        assert reader.refused(kv, 0, [n.name for n in nodes]) == {}
    finally:
        kv.set(report_key(0, "n1"), genuine.decode())


def test_the_genuine_failing_report_is_what_the_forgeries_would_have_done(
    nodes: list[Node],
) -> None:
    # The control for the table above: signed with the job's key, the same record
    # keeps n1 out, so each forgery above was refused for its flaw alone.
    kv = stranger(nodes[0].kv._store)  # type: ignore[attr-defined]
    genuine = kv.get(report_key(0, "n1"))
    assert genuine is not None
    kv.set(report_key(0, "n1"), sign(KEY, _failing("n1")))
    try:
        reader = HealthGate(HealthSettings(), KEY, "job")
        assert reader.refused(kv, 0, [n.name for n in nodes]) == {"n1": "forged"}
    finally:
        kv.set(report_key(0, "n1"), genuine.decode())


def test_a_forged_verdict_is_dropped(nodes: list[Node]) -> None:
    kv = stranger(nodes[0].kv._store)  # type: ignore[attr-defined]
    fake = Verdict(run_id="job", round=0, excluded=(Exclusion("n1", "h", ("forged",)),))
    kv.set(verdict_key(0), sign(health_key(b"y" * 32, "job"), fake))
    try:
        assert nodes[1].gate.closed(nodes[1].kv, 0, "n1") is None
        assert not [ev for ev, _ in nodes[1].events if ev is Event.NODE_EXCLUDED]
    finally:
        nodes[1].kv._store.data.pop(verdict_key(0))  # type: ignore[attr-defined]


def test_a_forged_order_count_costs_a_bounded_read(store: MemoryStore) -> None:
    stranger(store).set(checked_count(0), str(10**12))
    node = Node(store, "n0")
    try:
        node.check()  # reads at most MAX_LINKS names, then goes on
        assert node.gate.refused(node.kv, 0, ["n0"]) == {}
    finally:
        node.gate.close()


def test_a_node_that_cannot_listen_on_its_address_is_refused(store: MemoryStore) -> None:
    # 192.0.2.1 (TEST-NET-1) is on no interface here: peers could not reach it either.
    node = Node(store, "n0")
    try:
        node.gate.before_join(node.kv, 0, "n0", "192.0.2.1", [])
        why = node.gate.refused(node.kv, 0, ["n0"])["n0"]
        assert "cannot listen on 192.0.2.1" in why and "no interface of this host holds" in why
    finally:
        node.gate.close()


# -- one gate: silence and quarantine go through the same decision and verdict ----------
def test_a_joiner_that_never_reports_is_waited_for_only_as_long_as_the_bound(
    store: MemoryStore,
) -> None:
    good = Node(store, "n0", measure=False, wait=0.3)
    good.check()
    # n1 took its place but never reports; a stranger's forged report for it changes
    # nothing (it could otherwise hold the round open, or let n1 in unchecked).
    stranger(store).set(report_key(0, "n1"), msgspec.json.encode(_failing("n1")).decode())
    first = good.gate.admissions(good.kv, 0, ["n0", "n1"])
    assert first.pending == {"n1"} and first.refused == {}
    said = wait_for(
        lambda: good.gate.admissions(good.kv, 0, ["n0", "n1"]).refused or None,
        timeout=10,
        what="n1 refused for its silence",
    )
    assert said == {"n1": "no health report within 0.3s of joining"}
    good.gate.closing(good.kv, 0, ["n0", "n1"])
    assert good.gate.closed(good.kv, 0, "n0") is None
    (f,) = [f for ev, f in good.events if ev is Event.NODE_EXCLUDED]
    assert f["node"] == "n1" and f["by"] == "no_report" and f["this_node"] is False


class _Rdzv:
    elastic = True

    def __init__(self, name: str) -> None:
        self.name = name

    def node_names(self, round_: int) -> tuple[str, ...]:
        return ("n0", "n1", "n2")

    def withdraw(self) -> int:
        return 2


def test_a_quarantined_joiner_is_refused_by_the_closer_whatever_its_checks_say(
    store: MemoryStore,
) -> None:
    lkey = ledger_key(SECRET, "job")
    ledger = Ledger(MemoryKV(store), lkey, 3)
    for r in range(3):  # n1 the root cause of three failed rounds in a row
        ledger.write(0, Implication(round=r, node="n1", cause=Cause.FAILED, nodes=3, at=10.0 + r))
    # A stranger's ledger entry naming n0 is dropped: it cannot have n0 kept out.
    stranger(store).set(keys.Round(3).implicated(0), seal(b"k" * 32, Implication(
        round=3, node="n0", cause=Cause.FAILED, nodes=3, at=14.0)).decode())  # fmt: skip
    nodes = [Node(store, f"n{i}", measure=False) for i in range(3)]
    for n in nodes:
        n.check(round_=4)
        guard = QuarantineGuard(
            Ledger(n.kv, lkey, 3), Policy(3, 5, None), lambda *a, **k: None, min_nodes=2,
            clock=lambda: 100.0,
        )  # fmt: skip
        n.gate.consult(guard)
    ids = ["n0", "n1", "n2"]
    why = nodes[0].gate.admissions(nodes[0].kv, 4, ids)
    assert list(why.refused) == ["n1"] and not why.pending
    assert "node n1 is quarantined for the rest of the job" in why.refused["n1"]
    nodes[0].gate.closing(nodes[0].kv, 4, ids)
    assert "quarantined" in (nodes[1].gate.closed(nodes[1].kv, 4, "n1") or "")
    for n in nodes:
        n.gate.closed(n.kv, 4, n.name)
        (f,) = [f for ev, f in n.events if ev is Event.NODE_EXCLUDED]
        assert f["node"] == "n1" and f["by"] == "quarantine" and f["this_node"] is (n.name == "n1")
    # The same node, asking before it joins, withdraws with the same line.
    refusal = nodes[1].gate.before_round(_Rdzv("n1"), 4)  # type: ignore[arg-type]
    assert refusal is not None and refusal.by is By.QUARANTINE and refusal.goes_on
    assert nodes[0].gate.before_round(_Rdzv("n0"), 4) is None  # type: ignore[arg-type]


def _report(node: str, round_: int, compute: float) -> NodeReport:
    return NodeReport(run_id="job", round=round_, node=node, host="h", compute=compute, final=True)


@pytest.mark.parametrize(
    ("spare_compute", "refused"),
    [
        (9_000.0, True),  # a tenth of the running nodes' pace: not worth a restart
        (95_000.0, False),  # as fast as they are: the job may grow to take it in
    ],
)
def test_a_spare_is_judged_against_the_nodes_still_running(
    store: MemoryStore, spare_compute: float, refused: bool
) -> None:
    """While round 0 runs, only the spare checks for round 1: without the running nodes
    as its peers it had nobody to be slow against, looked admissible, and the job
    restarted to take it in only for round 1 to keep it out again, over and over."""
    closer = Node(store, "n0", measure=False)
    closer.kv.set(report_key(0, "n0"), sign(KEY, _report("n0", 0, 100_000.0)))
    closer.kv.set(report_key(1, "s"), sign(KEY, _report("s", 1, spare_compute)))
    # A stranger's report for the other running node is no peer: taken as one, its pace
    # would make the fast spare look slow.
    stranger(store).set(report_key(0, "n1"), msgspec.json.encode(_report("n1", 0, 1e12)).decode())
    said = closer.gate.admissions(closer.kv, 1, ["s"], running=["n0", "n1"])
    assert said.pending == frozenset()
    if refused:
        assert "compute 9000 products/s is 9% of its peers' median 100000" in said.refused["s"]
    else:
        assert said.refused == {}
    # The close of round 1 itself judges the spare among round 1's own reports only.
    assert closer.gate.admissions(closer.kv, 1, ["s"]).refused == {}
