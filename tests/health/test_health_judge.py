"""The health decisions as tables: the judge over reports, and the close rule with
refused joiners. No store, no process, no clock."""

from __future__ import annotations

import pytest

from stalwart.health.judge import Limits, judge, slow_links
from stalwart.health.records import Link, NodeReport
from stalwart.rendezvous.close_rule import (
    Close,
    CloseAction,
    CloseView,
    ElasticSettings,
    Joiner,
    TooFewAdmitted,
    Wait,
    close_rule,
)

L = Limits()
MS = 1e-3


def rep(node: str, compute: float = 1000.0, *problems: str, **links: float | None) -> NodeReport:
    return NodeReport(
        run_id="job",
        round=0,
        node=node,
        host=f"h-{node}",
        compute=compute,
        problems=problems,
        links=tuple(Link(p, t) for p, t in links.items()),
    )


def mesh(n: int, slow: dict[str, float] | None = None, base: float = 0.2 * MS) -> list[NodeReport]:
    """n nodes, each pair timed by its later node; *slow* adds seconds to a node's links."""
    slow = slow or {}
    names = [f"n{i}" for i in range(n)]
    out = []
    for i, a in enumerate(names):
        links = {b: base + slow.get(a, 0.0) + slow.get(b, 0.0) for b in names[:i]}
        out.append(rep(a, **links))
    return out


def out(reports: list[NodeReport]) -> list[str]:
    return [e.node for e in judge(reports, L)]


@pytest.mark.parametrize(
    ("computes", "expected"),
    [
        # A busy host: everyone between 0.6x and 1.6x of each other: nobody is out.
        ([900, 1500, 1100, 1400, 950, 1200, 1000, 1300], []),
        ([1000, 1000], []),
        ([1000, 350], []),  # 35 % of its one peer: above 30 %
        ([1000, 250], ["n1"]),  # two nodes: the slower against the faster
        ([1000, 1100, 100], ["n2"]),
        ([1000, 1100, 990, 1200, 80, 1050, 1000, 60], ["n4", "n7"]),  # two slow of eight
        ([1000, 0, 100], ["n2"]),  # 0: not measured, compared with nobody, compared by nobody
        ([0, 0, 0], []),
    ],
)
def test_compute_is_judged_against_the_peers_median(
    computes: list[float], expected: list[str]
) -> None:
    reports = [rep(f"n{i}", c) for i, c in enumerate(computes)]
    assert out(reports) == expected


def test_a_uniformly_slow_cluster_excludes_nobody() -> None:
    # Every node 100x slower than a "normal" machine: no constant, so nobody is out.
    assert out([rep(f"n{i}", 10.0 + i) for i in range(5)]) == []


def test_own_problems_exclude_and_are_kept_with_a_slow_compute() -> None:
    reports = [rep("n0"), rep("n1", 100.0, "disk full"), rep("n2")]
    (e,) = judge(reports, L)
    assert e.node == "n1" and e.host == "h-n1"
    assert e.reasons[0] == "disk full" and "10% of its peers' median" in e.reasons[1]


@pytest.mark.parametrize(
    ("n", "slow", "expected"),
    [
        (4, {}, []),
        (8, {}, []),
        (3, {"n2": 100 * MS}, ["n2"]),  # every link of n2 delayed: n2 found
        (8, {"n5": 50 * MS}, ["n5"]),
        (4, {"n0": 10 * MS}, []),  # within the slack a busy host is allowed
        (2, {"n1": 100 * MS}, []),  # one link: nothing to tell which end
    ],
)
def test_a_node_behind_a_slow_interface_is_found(
    n: int, slow: dict[str, float], expected: list[str]
) -> None:
    assert out(mesh(n, slow)) == expected


def test_an_unreachable_node_is_out_and_a_missing_link_is_no_evidence() -> None:
    reports = mesh(3)
    reports[2] = rep("n2", n0=None, n1=None)
    assert out(reports) == ["n2"]
    assert "every link broken" in judge(reports, L)[0].reasons[0]
    # A link nobody timed (two nodes that checked at once) accuses nobody.
    assert out([rep("n0"), rep("n1"), rep("n2", n0=0.3 * MS)]) == []


def test_one_slow_link_is_reported_and_excludes_nobody() -> None:
    reports = mesh(4)
    links = dict((lk.peer, lk.seconds) for lk in reports[3].links)
    links["n1"] = 80 * MS
    reports[3] = rep("n3", **links)
    assert out(reports) == []
    (found,) = slow_links(reports, [], L)
    assert found.startswith("n1 <-> n3: 80 ms")
    # Links of a node that is out are not reported again.
    assert slow_links(reports, ["n3"], L) == ()


def test_links_to_strangers_and_to_itself_are_ignored() -> None:
    reports = [rep("n0", n0=9.0, ghost=9.0), rep("n1", n0=0.2 * MS), rep("n2", n0=0.2 * MS)]
    assert out(reports) == []


# -- the close rule with the gate's answers -------------------------------------------
S = ElasticSettings(min_nodes=2, max_nodes=3, max_restarts=5, join_timeout=60, last_call_timeout=10)


def j(
    slot: int, *, refused: bool = False, hint: int | None = None, pending: bool = False
) -> Joiner:
    return Joiner(slot, f"n{slot}", hint, refused=refused, pending=pending)


def view(*joiners: Joiner, expected: set[str] | None = None, quiet: float = 0.0) -> CloseView:
    return CloseView(
        previous_running=False,
        joiners=joiners,
        expected=None if expected is None else frozenset(expected),
        quiet_for=quiet,
    )


@pytest.mark.parametrize(
    ("v", "s", "want"),
    [
        # Three joined, one refused: every place is taken, the two healthy close at once.
        (view(j(0), j(1, refused=True), j(2)), S, Close((0, 2))),
        # The refused node is not waited for on a restart: the others are back.
        (view(j(0, hint=0), j(1, hint=1, refused=True), j(2, hint=2), expected={"n0", "n1", "n2"}), S, Close((0, 2))),
        # Two joined, one refused: wait (a spare may come) until the last call...
        (view(j(0), j(1, refused=True)), S, Wait()),
        # ...then the round cannot form.
        (view(j(0), j(1, refused=True), quiet=10), S, TooFewAdmitted(1, ("n1",))),
        (view(j(0, refused=True), j(1, refused=True), j(2, refused=True)), S, TooFewAdmitted(0, ("n0", "n1", "n2"))),
        # One node, MIN 1: its refusal ends the job once the last call has passed.
        (view(j(0, refused=True), quiet=10), ElasticSettings(1, 2, 0, last_call_timeout=10), TooFewAdmitted(0, ("n0",))),
        # A refused joiner beyond MAX: a healthy spare takes its place.
        (view(j(0), j(1, refused=True), j(2), j(3)), S, Close((0, 2, 3))),
        # A joiner whose report is still due is waited for, even past the last call...
        (view(j(0), j(1), j(2, pending=True)), S, Wait()),
        (view(j(0), j(1), j(2, pending=True), quiet=10), S, Wait()),
        (view(j(0, hint=0), j(1, hint=1), j(2, hint=2, pending=True), expected={"n0", "n1", "n2"}), S, Wait()),
        # ...and does not end a round that cannot form yet (it may pass)...
        (view(j(0), j(1, refused=True), j(2, pending=True)), S, Wait()),
        # ...unless MAX are admitted without it: it is a spare.
        (view(j(0), j(1, pending=True), j(2), j(3)), S, Close((0, 2, 3))),
        # Nobody refused: the rule as before.
        (view(j(0), j(1), j(2)), S, Close((0, 1, 2))),
        (view(j(0), j(1)), S, Wait()),
    ],
)  # fmt: skip
def test_close_rule_with_refused_joiners(
    v: CloseView, s: ElasticSettings, want: CloseAction
) -> None:
    assert close_rule(v, s) == want


# -- the stock GPU check's rule (stalwart.health.gpu), over one node's devices -----------
@pytest.mark.parametrize(
    ("rates", "slow"),
    [
        ([700.0] * 8, []),
        ([700, 690, 710, 705, 300, 700, 698, 702], [4]),  # one GPU at 43 % of its mates
        ([700, 0.0], [1]),  # a device that could not run
        ([700, 400], []),  # 57 %: within the tolerance
        ([700], []),  # nothing to compare with
    ],
)
def test_a_gpu_far_slower_than_its_node_mates_is_found(rates: list[float], slow: list[int]) -> None:
    from stalwart.health.gpu import slow_devices

    assert [i for i, _, _ in slow_devices(rates)] == slow
