"""Which nodes are kept out of a round: a pure function of the nodes' reports.

A node is out when its own checks found a problem (a full disk, a failed user check),
when its compute is far below its peers', or when every one of its links is far slower
than its peers' links. Peers, not constants: on a busy shared host every node is slow
together, and nobody is out for it. Each node is compared with the median of the
*others* (itself left out), so with two nodes the slower one is measured against the
faster, and one slow node cannot drag the reference down to its own pace.

Links: a node's best link is its fastest echo to any peer. A node whose *best* link is
slow sits behind a slow interface (every path through it is slow); a link slow while
both of its ends have fast links elsewhere is a slow link, reported but excluding
nobody (either end could be at fault). Telling these apart needs a third node: with two
there is one link and nothing to compare it with.

Loss, the same way: a link's loss is the share of its probe's TCP segments that had to
be resent (both ways), and a node whose *least lossy* link loses far more than its
peers' least lossy links sits behind a lossy interface. A busy network that makes every
link resend a little raises the peers' reference with it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stalwart.health.records import (
    MAX_PROBLEMS,
    SEGMENTS_LIMIT,
    Exclusion,
    Link,
    LinkBlame,
    NodeReport,
)


@dataclass(frozen=True)
class Limits:
    """How far from its peers a node may be before it is kept out."""

    # Compute below this fraction of the peers' median is slow.
    slow_compute: float = 0.3
    # A best link time above this multiple of the peers' median (plus the slack) is slow.
    slow_link: float = 4.0
    # Seconds of scheduling noise a link may add on a busy host before it counts.
    link_slack: float = 0.02
    # A link resending more than this multiple of its peers' median share of segments
    # (plus the slack) is lossy.
    lossy_link: float = 4.0
    # The share of segments a healthy link may resend (tail-loss probes and spurious
    # resends on a busy host: up to 1.4 % on one healthy probe here, docs/health.md).
    loss_slack: float = 0.015
    # Segments a probe must have counted for its share to say anything.
    loss_segments: int = 100


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _pairs(reports: Sequence[NodeReport]) -> dict[frozenset[str], float]:
    """The best time seen for each link, measured from either end (inf: unreachable)."""
    nodes = {r.node for r in reports}
    best: dict[frozenset[str], float] = {}
    for r in reports:
        for link in r.links:
            if link.peer == r.node or link.peer not in nodes:
                continue
            pair = frozenset((r.node, link.peer))
            t = math.inf if link.seconds is None else link.seconds
            best[pair] = min(best.get(pair, math.inf), t)
    return best


def _best(node: str, links: dict[frozenset[str], float], without: str | None = None) -> float:
    times = [t for pair, t in links.items() if node in pair and without not in pair]
    return min(times, default=math.nan)


@dataclass(frozen=True, order=True)
class _Loss:
    """A link's resent share of its probe's segments (ordered by that share)."""

    rate: float
    resent: int
    sent: int

    def __str__(self) -> str:
        return f"{self.resent} of {self.sent} segments ({self.rate:.1%})"


def _loss_of(link: Link, lim: Limits) -> _Loss | None:
    """What a probe's counts say (None: too few segments, or counts no probe could have,
    negative, NaN or beyond the limit: no evidence either way)."""
    sent, resent = link.sent, link.resent
    if not (0 <= resent <= sent <= SEGMENTS_LIMIT and sent >= max(1, lim.loss_segments)):
        return None
    return _Loss(resent / sent, int(resent), int(sent))


def _losses(reports: Sequence[NodeReport], lim: Limits) -> dict[frozenset[str], _Loss]:
    """The loss of each link, from either end's probe (the lower where both counted)."""
    nodes = {r.node for r in reports}
    out: dict[frozenset[str], _Loss] = {}
    for r in reports:
        for link in r.links:
            if link.peer == r.node or link.peer not in nodes:
                continue
            loss = _loss_of(link, lim)
            pair = frozenset((r.node, link.peer))
            if loss is not None and (pair not in out or loss < out[pair]):
                out[pair] = loss
    return out


def _least(
    node: str, losses: dict[frozenset[str], _Loss], without: str | None = None
) -> _Loss | None:
    return min(
        (x for pair, x in losses.items() if node in pair and without not in pair), default=None
    )


def _loss_problem(node: str, losses: dict[frozenset[str], _Loss], lim: Limits) -> str | None:
    mine = _least(node, losses)
    others = {n for pair in losses for n in pair} - {node}
    refs = [x.rate for o in others if (x := _least(o, losses, without=node)) is not None]
    if mine is None or not refs:
        return None
    ref = statistics.median(refs)
    if mine.rate <= lim.lossy_link * ref + lim.loss_slack:
        return None
    return (
        f"its links lose packets: TCP resent {mine} on its least lossy link, against "
        f"{ref:.1%} on its peers' (median)"
    )


def _compute_problem(r: NodeReport, reports: Sequence[NodeReport], lim: Limits) -> str | None:
    peers = [p.compute for p in reports if p.node != r.node and p.compute > 0]
    if r.compute <= 0 or not peers:
        return None
    ref = statistics.median(peers)
    if r.compute >= lim.slow_compute * ref:
        return None
    return (
        f"compute {r.compute:.0f} products/s is {r.compute / ref:.0%} of its peers' median "
        f"{ref:.0f} (below {lim.slow_compute:.0%})"
    )


def _link_problem(node: str, links: dict[frozenset[str], float], lim: Limits) -> str | None:
    mine = _best(node, links)
    others = {n for pair in links for n in pair} - {node}
    # Each peer's best link that does not pass through this node.
    refs = [b for o in others if not math.isnan(b := _best(o, links, without=node))]
    finite = [b for b in refs if math.isfinite(b)]
    if math.isnan(mine) or not finite:
        return None
    ref = statistics.median(finite)
    if math.isinf(mine):
        return "no peer could reach its echo server (every link broken)"
    if mine <= lim.slow_link * ref + lim.link_slack:
        return None
    return f"its fastest link takes {_ms(mine)}, {mine / ref:.0f}x its peers' median {_ms(ref)}"


def _collective(
    reps: Sequence[NodeReport], lossy: frozenset[str] = frozenset()
) -> tuple[dict[str, str], tuple[LinkBlame, ...]]:
    """What the round's collective link check found, by its members' word: a node is
    slow when more than half of the members whose conclusion names it as a member blame
    it (they ran the same decision over the same timings, so they agree unless one was
    cut off; a conclusion that came to nothing counts against nobody). Its slow links,
    from any member's conclusion.

    A conclusion among whose members is a node the echoes found *lossy* blames nobody
    but such nodes: that node's pairs pass or fail by chance (a resend costs a round
    trip, a lost tail a timer), so a healthy node timed against it as "a good partner"
    can look slow (seen at 5 % loss, docs/health.md)."""
    votes: dict[str, int] = {}
    voters: dict[str, int] = {}
    why: dict[str, str] = {}
    links: dict[LinkBlame, None] = {}
    for r in reps:
        c = r.collective
        if c is None or c.void or r.node not in c.members:
            continue
        for m in set(c.members):
            voters[m] = voters.get(m, 0) + 1
        chance = not lossy.isdisjoint(c.members)
        for b in c.nodes:
            if b.node in c.members and (not chance or b.node in lossy):
                votes[b.node] = votes.get(b.node, 0) + 1
                why.setdefault(b.node, b.reason)
        links.update(dict.fromkeys(c.links))
    slow = {n: why[n] for n, v in votes.items() if 2 * v > voters[n]}
    return slow, tuple(links)


def against_peers(reports: Iterable[NodeReport], lim: Limits) -> dict[str, tuple[str, ...]]:
    """What comparing each node of *reports* with its peers found (slow compute, slow
    links, by echo and by the collective check); a node with nothing against it is
    absent."""
    reps = list(reports)
    links = _pairs(reps)
    losses = _losses(reps, lim)
    lossy = {r.node: why for r in reps if (why := _loss_problem(r.node, losses, lim)) is not None}
    collective, _ = _collective(reps, frozenset(lossy))
    found: dict[str, tuple[str, ...]] = {}
    for r in reps:
        mine = (
            _compute_problem(r, reps, lim),
            _link_problem(r.node, links, lim),
            lossy.get(r.node),
            collective.get(r.node),
        )
        if any(f is not None for f in mine):
            found[r.node] = tuple(f for f in mine if f is not None)
    return found


def judge(reports: Iterable[NodeReport], lim: Limits) -> tuple[Exclusion, ...]:
    """The nodes of *reports* kept out of the round, in the reports' order."""
    reps = list(reports)
    peers = against_peers(reps, lim)
    out: list[Exclusion] = []
    for r in reps:
        reasons = [*r.problems, *peers.get(r.node, ())]
        if reasons:
            out.append(Exclusion(r.node, r.host, tuple(reasons[:MAX_PROBLEMS])))
    return tuple(out)


def slow_links(
    reports: Iterable[NodeReport], excluded: Iterable[str], lim: Limits
) -> tuple[str, ...]:
    """Links much slower than the best link of either end, between nodes still in: found
    and reported, but no node is kept out for them."""
    reps = list(reports)
    out_ = set(excluded)
    links = _pairs(reps)
    found: list[str] = []
    for pair, t in sorted(links.items(), key=lambda kv: sorted(kv[0])):
        a, b = sorted(pair)
        if a in out_ or b in out_:
            continue
        ref = max(_best(a, links), _best(b, links))
        if math.isfinite(ref) and t > lim.slow_link * ref + lim.link_slack:
            took = "unreachable" if math.isinf(t) else _ms(t)
            found.append(f"{a} <-> {b}: {took} (each end's best link: {_ms(ref)})")
    losses = _losses(reps, lim)
    for pair, x in sorted(losses.items(), key=lambda kv: sorted(kv[0])):
        a, b = sorted(pair)
        if a in out_ or b in out_:
            continue
        ends = [e.rate for n in (a, b) if (e := _least(n, losses)) is not None]
        least = max(ends)
        if x.rate > lim.lossy_link * least + lim.loss_slack:
            found.append(f"{a} <-> {b}: TCP resent {x} (each end's least lossy link: {least:.1%})")
    _, collective = _collective(reps)
    found += [f"{x.reason} (collective check)" for x in collective if not out_ & {x.a, x.b}]
    return tuple(found)
