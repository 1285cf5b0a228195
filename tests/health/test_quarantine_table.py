"""The quarantine's decisions as tables: which node a failed round points at, K of the
last M, the window sliding, release after a time or never, and whether the job goes on."""

from __future__ import annotations

import pytest

from stalwart.health.quarantine import (
    Cause,
    Implication,
    Policy,
    implicate,
    standing,
    withdrawal,
)
from stalwart.rendezvous.api import NodeExcluded, NodeLost, ShutdownRequested, WorkerFailed

NODES = ("a@10.0.0.1", "b@10.0.0.2", "c@10.0.0.3")


def _w(node: int, ts: float, reason: str = "", rank: int = 0) -> WorkerFailed:
    return WorkerFailed(
        node_rank=node, local_rank=0, rank=rank, exitcode=1, timestamp=ts, reason=reason
    )


@pytest.mark.parametrize(
    ("records", "node", "cause"),
    [
        ([_w(1, 5.0), _w(0, 6.0), _w(2, 6.5)], NODES[1], Cause.FAILED),
        ([_w(0, 9.0), _w(2, 4.0, reason="rank 2 hung in its own code")], NODES[2], Cause.HUNG),
        ([_w(0, 1.0), NodeExcluded(node_rank=2, reason="straggler")], NODES[2], Cause.EXCLUDED),
        ([_w(0, 1.0), NodeLost(node_rank=1)], NODES[1], Cause.LOST),
        ([_w(7, 1.0)], "", Cause.FAILED),  # a node rank the round did not have: nobody
    ],
    ids=["first-failure", "hang-root", "straggler", "lost", "unknown-rank"],
)
def test_implicate_points_at_the_root_cause_node(
    records: list[WorkerFailed], node: str, cause: Cause
) -> None:
    e = implicate(records, NODES, 4, 100.0)
    assert e is not None
    assert (e.round, e.node, e.cause, e.nodes, e.at) == (4, node, cause, 3, 100.0)


def test_implicate_says_how_the_root_worker_ended() -> None:
    crashed = WorkerFailed(node_rank=0, local_rank=0, signal="SIGSEGV", timestamp=1.0)
    assert [
        e.reason if e else None
        for e in (
            implicate([_w(1, 1.0, rank=3)], NODES, 0, 1.0),
            implicate([crashed], NODES, 0, 1.0),
        )
    ] == ["rank 3 exit code 1", "rank ? signal SIGSEGV"]


def test_implicate_blames_nobody_for_a_shutdown_or_nothing() -> None:
    assert implicate([_w(0, 1.0), ShutdownRequested(node_rank=1)], NODES, 0, 1.0) is None
    assert implicate([], NODES, 0, 1.0) is None


def test_implicate_bounds_what_it_writes() -> None:
    e = implicate([_w(0, 1.0, reason="x" * 100_000)], ("n" * 10_000,), 0, 1.0)
    assert e is not None and len(e.node) == 300 and len(e.reason) == 512


def _ledger(names: str, nodes: int = 3, t0: float = 1000.0, dt: float = 10.0) -> list[Implication]:
    """One failed round per letter ('-' implicates nobody), *dt* seconds apart."""
    return [
        Implication(
            round=i,
            node="" if ch == "-" else ch,
            cause=Cause.FAILED,
            nodes=nodes,
            at=t0 + dt * i,
        )
        for i, ch in enumerate(names)
    ]


K3M5 = Policy(after=3, window=5, hold=None)


@pytest.mark.parametrize(
    ("names", "policy", "quarantined"),
    [
        ("", K3M5, {}),
        ("aa", K3M5, {}),
        ("aaa", K3M5, {"a": 2}),  # three in a row: at the third
        ("aba-a", K3M5, {"a": 4}),  # a at 0, 2, 4: three of the last five
        ("abab-a", K3M5, {}),  # a at 0, 2, 5: round 0 has slid out by round 5
        ("ab-bab", K3M5, {"b": 5}),  # b at 1, 3, 5: all in the window of round 5
        ("abcabcabc", K3M5, {}),  # spread evenly: never 3 of 5
        ("a---a---a", K3M5, {}),  # the window slides past each old one
        ("a-a-a", K3M5, {"a": 4}),  # just inside the window
        ("a--a--a", K3M5, {}),  # just outside
        ("aaabbb", K3M5, {"a": 2, "b": 5}),
        ("ab", Policy(1, 1, None), {"a": 0, "b": 1}),
        ("aaaa", Policy(4, 4, None), {"a": 3}),
    ],
)
def test_k_of_the_last_m(names: str, policy: Policy, quarantined: dict[str, int]) -> None:
    got = standing(_ledger(names), policy, now=1e6)
    assert {q.node: q.round for q in got.active} == quarantined
    assert got.released == ()


def test_rounds_of_one_node_blame_nobody_but_take_a_place_in_the_window() -> None:
    alone = _ledger("aaa", nodes=1)
    assert standing(alone, K3M5, now=1e6).active == ()
    mixed = [*_ledger("aa"), *_ledger("---", nodes=1)]
    mixed = [Implication(round=i, node=e.node or "a", cause=e.cause, nodes=e.nodes, at=e.at)
             for i, e in enumerate(mixed)]  # fmt: skip
    # rounds 2..4 had one node ("a" alone): only rounds 0, 1 count
    assert standing(mixed, K3M5, now=1e6).active == ()


def test_release_after_the_hold_and_never() -> None:
    ledger = _ledger("aaa")  # quarantined at round 2, at t=1020
    held = Policy(3, 5, hold=60.0)
    assert [q.until for q in standing(ledger, held, now=1079.0).active] == [1080.0]
    released = standing(ledger, held, now=1080.0)
    assert released.active == () and [q.node for q in released.released] == ["a"]
    forever = standing(ledger, K3M5, now=1e12)
    assert [q.until for q in forever.active] == [None] and forever.released == ()


def test_a_released_node_starts_again_from_zero() -> None:
    held = Policy(3, 5, hold=25.0)
    # Quarantined at round 2 (t=1020), released at t=1045: rounds 5 and 6 (after the
    # release) are not enough on their own; a third one (round 7) is.
    names = "aaa--aa"
    assert standing(_ledger(names), held, now=1065.0).active == ()
    assert [q.node for q in standing(_ledger(names), held, now=1065.0).released] == ["a"]
    again = standing(_ledger(names + "a"), held, now=1071.0)
    assert [(q.node, q.round) for q in again.active] == [("a", 7)]


def test_the_first_entry_of_a_round_wins() -> None:
    ledger = [*_ledger("aaa"), Implication(round=2, node="b", cause=Cause.LOST, nodes=3, at=0)]
    assert [q.node for q in standing(ledger, K3M5, now=1e6).active] == ["a"]
    assert standing(list(reversed(ledger[:3])), K3M5, now=1e6).of("a") is not None


def test_the_line_names_the_node_and_why() -> None:
    (q,) = standing(_ledger("aaa"), K3M5, now=1e6).active
    assert q.line() == (
        "node a is quarantined for the rest of the job: implicated in 3 of the last 5 "
        "failed rounds (round 2; failed, failed, failed)"
    )


@pytest.mark.parametrize(
    ("elastic", "others", "min_nodes", "goes_on", "says"),
    [
        (True, 2, 2, True, "the job goes on with the other 2 node(s)"),
        (True, 1, 2, False, "1 other node(s) remain, fewer than the 2 the job needs"),
        (True, 0, 1, False, "0 other node(s) remain, fewer than the 1"),  # the last node
        (False, 5, 3, False, "a job of fixed membership cannot go on without it"),
    ],
)
def test_withdrawal(elastic: bool, others: int, min_nodes: int, goes_on: bool, says: str) -> None:
    (q,) = standing(_ledger("aaa"), K3M5, now=1e6).active
    w = withdrawal(q, elastic=elastic, others=others, min_nodes=min_nodes)
    assert w.goes_on is goes_on
    assert w.line.startswith("node a is quarantined") and says in w.line
