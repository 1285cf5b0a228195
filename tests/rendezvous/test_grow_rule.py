"""The job grows when nodes wait: the pure rules, as tables."""

from __future__ import annotations

import pytest

from stalwart.launch.round.decide import Restart, RoundOutcome, RoundView, Stop, decide, grows
from stalwart.rendezvous import NodeLost, NodesWaiting, membership_change
from stalwart.rendezvous.close_rule import ElasticSettings, Joiner, admissible_spares

S = ElasticSettings(min_nodes=1, max_nodes=2, max_restarts=3)
RUN = frozenset({"a"})


@pytest.mark.parametrize(
    ("spares", "want"),
    [
        ((), 0),
        ((Joiner(0, "b", None),), 1),
        ((Joiner(0, "b", None), Joiner(1, "c", None)), 1),  # room for one under MAX
        ((Joiner(0, "b", None, alive=False),), 0),  # its keep-alive stopped
        ((Joiner(0, "b", None, left=True),), 0),
        ((Joiner(0, "b", None, refused=True),), 0),  # the health gate keeps it out
        ((Joiner(0, "b", None, pending=True),), 0),  # its health report is still due
        ((Joiner(0, "a", 0),), 0),  # a running node is not a spare
        ((Joiner(0, "b", None), Joiner(1, "b", None)), 1),  # one node, two forged slots
    ],
)
def test_admissible_spares(spares: tuple[Joiner, ...], want: int) -> None:
    assert admissible_spares(RUN, spares, S) == want


def test_a_full_job_admits_nobody() -> None:
    assert admissible_spares(frozenset({"a", "b"}), (Joiner(0, "c", None),), S) == 0


@pytest.mark.parametrize(
    ("elastic", "waiting", "attempt", "want"),
    [(True, 1, 0, True), (True, 0, 0, False), (False, 1, 0, False), (True, 1, 3, False)],
)
def test_grows_only_while_a_restart_is_left(
    elastic: bool, waiting: int, attempt: int, want: bool
) -> None:
    assert grows(elastic, waiting, attempt, 3) is want


def test_a_grow_restarts_every_node_and_fails_nothing() -> None:
    rec = NodesWaiting(node_rank=0, reason="1 node(s) waiting", waiting=1)
    assert membership_change([rec]) and not membership_change([])
    assert not membership_change([rec, NodeLost(node_rank=1)])
    mine = decide(RoundView(RoundOutcome.NODES_WAITING, 1, 3, (rec,)))
    peer = decide(RoundView(RoundOutcome.PEER_FAILURE, 1, 3, (rec,)))
    for move in (mine, peer):
        assert isinstance(move, Restart) and move.reason == "nodes_waiting" and not move.workers
    # A forged record at the last attempt buys no extra round.
    assert isinstance(decide(RoundView(RoundOutcome.PEER_FAILURE, 3, 3, (rec,))), Stop)
