"""Which groups the collective link check times next, and whom it blames: pure.

The check times one fixed-size all-reduce per group, stage by stage. Stage 0 is the
whole group of the round's nodes side by side with a first set of disjoint pairs. A
pair is *slow* when its time is more than ``Limits.slow_link`` times the median of the
other pairs' times (plus ``link_slack``), or when it failed: peers, not a constant, so a
busy host that slows every pair blames nobody. A slow pair (a, b) is split: a and b
each get a partner known to be good; the end whose new pair is slow too is the slow
node, and when both new pairs are fine the link a-b is the slow one (a link blames no
node: either end could be at fault). When every pair so far is fine but the whole group
is slow or failed, the fault lies on a link not yet timed: the next round-robin set of
pairs is timed, until every link has been.

Nodes are names; the check's processes all run this same function over the same
trials, so they agree on every stage without talking about it.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from stalwart.health.judge import Limits

Pair = tuple[str, str]


@dataclass(frozen=True)
class Trial:
    """One group's timed all-reduce: its nodes, and seconds (None: it failed)."""

    nodes: tuple[str, ...]
    seconds: float | None


@dataclass(frozen=True)
class TimeGroups:
    """Time these groups next. Each node takes its groups in this order, so groups that
    share no node run side by side (stage 0's whole group runs first, then its pairs)."""

    groups: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class SlowNode:
    node: str
    reason: str


@dataclass(frozen=True)
class SlowLink:
    a: str
    b: str
    reason: str


@dataclass(frozen=True)
class Found:
    """The check is over: the slow or broken nodes and links it found (none: healthy)."""

    nodes: tuple[SlowNode, ...] = ()
    links: tuple[SlowLink, ...] = ()


Step = TimeGroups | Found


def _ms(t: float | None) -> str:
    return "failed" if t is None else f"{t * 1e3:.3g} ms"


def matchings(members: Sequence[str]) -> list[tuple[Pair, ...]]:
    """Round-robin sets of disjoint pairs that together hold every pair once (the
    circle method; an odd node out sits one set out in turn)."""
    ring: list[str | None] = list(members)
    if len(ring) % 2:
        ring.append(None)
    n = len(ring)
    out: list[tuple[Pair, ...]] = []
    for _ in range(n - 1):
        pairs = []
        for i in range(n // 2):
            a, b = ring[i], ring[n - 1 - i]
            if a is not None and b is not None:
                pairs.append((a, b))
        out.append(tuple(pairs))
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return out


def _key(nodes: Sequence[str]) -> frozenset[str]:
    return frozenset(nodes)


@dataclass(frozen=True)
class _Seen:
    pairs: dict[frozenset[str], float | None]
    whole: float | None
    whole_done: bool


def _seen(members: Sequence[str], trials: Sequence[Trial]) -> _Seen:
    pairs: dict[frozenset[str], float | None] = {}
    whole: float | None = None
    done = False
    for t in trials:
        if len(t.nodes) == 2:
            pairs[_key(t.nodes)] = t.seconds
        elif _key(t.nodes) == _key(members):
            whole, done = t.seconds, True
    return _Seen(pairs, whole, done)


def _ref(pairs: dict[frozenset[str], float | None]) -> float | None:
    """The reference pace: the lower median over nodes of each node's best pair. A slow
    node's pairs are all slow, but each healthy node has a fast one, so while most
    nodes are healthy the reference is theirs however many slow pairs were timed."""
    best: dict[str, float] = {}
    for p, t in pairs.items():
        if t is not None:
            for n in p:
                best[n] = min(best.get(n, t), t)
    return statistics.median_low(best.values()) if best else None


def _slow(t: float | None, ref: float | None, lim: Limits) -> bool:
    if ref is None:
        return False  # nothing to compare with: no evidence
    return t is None or t > lim.slow_link * ref + lim.link_slack


def next_step(members: Sequence[str], trials: Sequence[Trial], lim: Limits) -> Step:
    """What to time after *trials* (every stage so far) among *members*, or what the
    check found. The stages stay bounded: at most one per round-robin set of pairs plus
    two per slow pair."""
    if len(members) < 3:
        # Two nodes share one link and nothing to compare it with; one has no link.
        sets = matchings(members)
        if len(members) == 2 and not trials:
            return TimeGroups(sets[0])
        return Found()
    sets = matchings(members)
    seen = _seen(members, trials)
    if not seen.whole_done:
        first = sets[0]
        if len(members) % 2:
            # The node the first set leaves out gets a pair too (after its partner's
            # first one): every node is then timed against a peer in this stage.
            paired = {n for q in first for n in q}
            (out,) = (n for n in members if n not in paired)
            first = (*first, (out, members[0] if members[0] != out else members[1]))
        return TimeGroups((tuple(members), *first))
    pairs = seen.pairs
    ref = _ref(pairs)
    suspects = sorted((p for p, t in pairs.items() if _slow(t, ref, lim)), key=sorted)
    good = {n for p, t in pairs.items() if p not in suspects and t is not None for n in p}

    def slow_end(end: str, other: str) -> bool | None:
        """Whether *end* is slow with a good partner (None: not timed yet)."""
        partners = sorted(good - {end, other})
        tried = [q for q in partners if _key((end, q)) in pairs]
        if tried:
            return _slow(pairs[_key((end, tried[0]))], ref, lim)
        return None if partners else False  # no good partner to tell by: no blame

    slow: dict[str, frozenset[str]] = {}  # slow node -> the suspect pair that showed it
    for p in suspects:
        for end, other in itertools.permutations(sorted(p)):
            if slow_end(end, other):
                slow.setdefault(end, p)
    nodes = [
        SlowNode(
            n,
            f"the collective link check found it slow: a {len(members)}-node group took "
            f"{_ms(seen.whole)}, a pair with it {_ms(pairs[p])} against {_ms(ref)} for "
            f"the typical node's best pair",
        )
        for n, p in slow.items()
    ]
    links: list[SlowLink] = []
    wanted: list[Pair] = []
    for p in suspects:
        a, b = sorted(p)
        if a in slow or b in slow:
            continue  # explained by a slow end
        ends = {a: slow_end(a, b), b: slow_end(b, a)}
        if None not in ends.values():
            what = "failed" if pairs[p] is None else _ms(pairs[p])
            links.append(SlowLink(a, b, f"{a} <-> {b}: {what} against {_ms(ref)}"))
            continue
        for end, other in ((a, b), (b, a)):
            if ends[end] is None:
                partners = sorted(good - {end, other})
                wanted.append((end, partners[len(wanted) % len(partners)]))
    if wanted:
        return TimeGroups(_disjoint(wanted, pairs))
    if nodes or links:
        return Found(tuple(nodes), tuple(links))
    # Every pair fine: is the whole group's time explained by them?
    if ref is not None and not _slow(seen.whole, ref, lim):
        return Found()
    for pairs_set in sets:
        todo = tuple(q for q in pairs_set if _key(q) not in pairs)
        if todo:
            return TimeGroups(todo)
    return Found()  # every link timed and fine: the group's own time is no one's fault


def _disjoint(wanted: list[Pair], pairs: dict[frozenset[str], float | None]) -> tuple[Pair, ...]:
    """As many of *wanted* as share no node, for one stage (the rest come next)."""
    used: set[str] = set()
    out: list[Pair] = []
    for a, b in wanted:
        if a in used or b in used or _key((a, b)) in pairs:
            continue
        used |= {a, b}
        out.append((a, b))
    return tuple(out)
