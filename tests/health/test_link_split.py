"""The collective link check's decision as a table: which groups to time next and whom
to blame (``linksplit.next_step``), driven against a modelled network until it
concludes. No process, no store, no clock."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from stalwart.health.judge import Limits, judge
from stalwart.health.linkcheck import GATHER, GATHER_CAP, seal_now
from stalwart.health.linksplit import Found, TimeGroups, Trial, matchings, next_step
from stalwart.health.records import Blame, CollectiveLinks, NodeReport

MS = 1e-3
L = Limits()


class Net:
    """A group's all-reduce time: a base time with noise, plus the worst delay of its
    nodes and of its links; None when it holds a broken node or link."""

    def __init__(
        self,
        slow_nodes: dict[str, float] | None = None,
        slow_links: dict[tuple[str, str], float | None] | None = None,
        broken: Sequence[str] = (),
        noise: float = 0.5,
        scale: float = 1.0,
        seed: int = 0,
    ) -> None:
        self.nodes = slow_nodes or {}
        self.links = {frozenset(p): t for p, t in (slow_links or {}).items()}
        self.broken = set(broken)
        self.noise = noise
        self.scale = scale
        self.rng = random.Random(seed)

    def time(self, group: Sequence[str]) -> float | None:
        if self.broken & set(group):
            return None
        extra = max((self.nodes.get(n, 0.0) for n in group), default=0.0)
        for pair in itertools.combinations(group, 2):
            t = self.links.get(frozenset(pair), 0.0)
            if t is None:
                return None
            extra = max(extra, t)
        base = 2 * MS * (1 + self.noise * self.rng.random()) * (1 if len(group) == 2 else 1.8)
        return (base + extra) * self.scale


def drive(members: list[str], net: Net) -> tuple[Found, int]:
    trials: list[Trial] = []
    stages = 0
    while isinstance(step := next_step(members, trials, L), TimeGroups):
        if trials:  # after stage 0 (the whole group, then its pairs): side by side
            used = [n for g in step.groups for n in g]
            assert len(used) == len(set(used)), f"groups of one stage share a node: {step}"
        trials += [Trial(g, net.time(g)) for g in step.groups]
        stages += 1
        assert stages <= 12, trials
    return step, stages


def names(n: int) -> list[str]:
    return [f"n{i}" for i in range(n)]


@pytest.mark.parametrize(
    ("n", "net", "slow", "links", "most"),
    [
        # Healthy, noisy: one stage, nobody blamed.
        (8, Net(), [], [], 1),
        (2, Net(), [], [], 1),
        (5, Net(seed=3), [], [], 1),
        # A busy host: every group ten times slower, together: nobody blamed.
        (4, Net(scale=10.0), [], [], 1),
        # One slow node (every link through it slow), found by splitting its pair.
        (8, Net(slow_nodes={"n5": 40 * MS}), ["n5"], [], 2),
        (4, Net(slow_nodes={"n0": 40 * MS}), ["n0"], [], 2),
        # Three nodes: the one the first set leaves out is paired in stage 0 too.
        (3, Net(slow_nodes={"n0": 40 * MS}), ["n0"], [], 2),
        # Odd count, the node the first set leaves out is the slow one.
        (5, Net(slow_nodes={"n4": 40 * MS}, seed=1), ["n4"], [], 2),
        # A broken node: every group with it fails.
        (8, Net(broken=["n3"]), ["n3"], [], 2),
        # Two slow nodes at once.
        (8, Net(slow_nodes={"n1": 40 * MS, "n6": 60 * MS}), ["n1", "n6"], [], 2),
        # One slow link between nodes fast elsewhere: the link, no node.
        (8, Net(slow_links={("n2", "n5"): 40 * MS}), [], [("n2", "n5")], 2),
        # One broken link: the group fails, every pair of the first set is fine; the
        # round-robin sets find it, and its ends are fine with others.
        (6, Net(slow_links={("n1", "n3"): None}), [], [("n1", "n3")], 4),
        # Two nodes: one link and nothing to compare it with.
        (2, Net(slow_nodes={"n1": 40 * MS}), [], [], 1),
    ],
)
def test_splitting_finds_the_slow_or_broken_node_or_link(
    n: int, net: Net, slow: list[str], links: list[tuple[str, str]], most: int
) -> None:
    found, stages = drive(names(n), net)
    assert sorted(b.node for b in found.nodes) == slow, found
    assert sorted((x.a, x.b) for x in found.links) == links, found
    assert stages <= most, stages
    for b in found.nodes:
        assert "typical node's best pair" in b.reason


def test_the_first_stage_is_the_whole_group_beside_a_set_of_pairs() -> None:
    step = next_step(names(4), [], L)
    assert step == TimeGroups((("n0", "n1", "n2", "n3"), ("n0", "n3"), ("n1", "n2")))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_round_robin_sets_hold_every_pair_once(n: int) -> None:
    sets = matchings(names(n))
    pairs = [frozenset(p) for s in sets for p in s]
    assert len(pairs) == len(set(pairs)) == n * (n - 1) // 2
    for s in sets:
        flat = [x for p in s for x in p]
        assert len(flat) == len(set(flat))


def test_healthy_noisy_clusters_blame_nobody_in_many_draws() -> None:
    for seed in range(200):
        found, _ = drive(names(8), Net(noise=1.5, seed=seed))
        assert found == Found(), (seed, found)


@pytest.mark.parametrize(
    ("came", "coming", "expected", "quiet", "waited", "sealed"),
    [
        (8, 8, 8, 0.0, 0.0, True),  # every node the job can have came
        (3, 3, 8, 0.2, 0.2, False),  # newcomers may still start
        (3, 3, 8, GATHER, GATHER, True),  # everyone checking came; nobody new for a while
        (3, 5, 8, 5.0, 5.0, False),  # two still checking themselves: waited for
        (3, 5, 8, 0.1, GATHER_CAP, True),  # ... but no longer than the cap
        (9, 9, 8, 0.0, 0.0, True),  # a stranger raised the count: no longer wait
        (3, 10**9, 8, 5.0, 5.0, False),  # a stranger raised "coming": the cap bounds it
        # A spare checking again alone while the others still stop their workers: no
        # check of one (the others would come after it was sealed); the cap bounds it.
        (1, 1, 4, 5.0, 5.0, False),
        (1, 1, 4, 0.1, GATHER_CAP, True),
    ],
)
def test_when_the_members_are_sealed(
    came: int, coming: int, expected: int, quiet: float, waited: float, sealed: bool
) -> None:
    assert seal_now(came, coming, expected, quiet, waited) is sealed


def report(node: str, members: tuple[str, ...], *blamed: str, void: str = "") -> NodeReport:
    found = CollectiveLinks(
        members=members, nodes=tuple(Blame(b, f"{b} slow") for b in blamed), void=void
    )
    return NodeReport(run_id="job", round=0, node=node, host=node, collective=found)


FOUR = ("n0", "n1", "n2", "n3")


@pytest.mark.parametrize(
    ("reports", "out"),
    [
        # Every member blames n3 (itself included): out.
        ([report(n, FOUR, "n3") for n in FOUR], ["n3"]),
        # Three of four (one was cut off and concluded nothing): out.
        ([*(report(n, FOUR, "n3") for n in FOUR[:3]), report("n3", FOUR, void="timeout")], ["n3"]),
        # One member alone blames a peer: a majority is needed.
        ([report("n0", FOUR, "n1"), *(report(n, FOUR) for n in FOUR[1:])], []),
        # Two of four: not more than half.
        ([report("n0", FOUR, "n1"), report("n2", FOUR, "n1"), report("n1", FOUR), report("n3", FOUR)], []),
        # A conclusion that voided (a forged timing) blames nobody.
        ([report(n, FOUR, "n2", void="a forged timing") for n in FOUR], []),
        # A report whose conclusion does not list its own node as a member: no vote.
        ([report(n, ("n0", "x", "y"), "n0") for n in FOUR[1:]], []),
    ],
)  # fmt: skip
def test_the_members_majority_decides_whom_the_collective_check_keeps_out(
    reports: list[NodeReport], out: list[str]
) -> None:
    assert [e.node for e in judge(reports, L)] == out
    for e in judge(reports, L):
        assert f"{e.node} slow" in e.reasons
