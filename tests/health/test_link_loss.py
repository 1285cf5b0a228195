"""Loss on a link, as tables: what the judge makes of the segments each probe counted
resent (``judge.against_peers``, ``slow_links``), and what a report or an echo server's
answer may carry. No process, no network: the namespaces' test is in
``tests/multinode/test_health_netns.py``."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from stalwart.health import probe
from stalwart.health.judge import Limits, judge, slow_links
from stalwart.health.records import (
    SEGMENTS_LIMIT,
    BadRecord,
    Link,
    NodeReport,
    health_key,
    open_report,
    sign,
)

L = Limits()
MS = 1e-3
SENT = 440  # what a probe counts on a 1500-byte MTU: 3 x 16 KiB + 4 x 64 KiB, both ways


def rep(node: str, links: dict[str, tuple[int, int]]) -> NodeReport:
    """A report whose links are all fast (0.2 ms) with these (sent, resent) counts."""
    return NodeReport(
        run_id="job",
        round=0,
        node=node,
        host=f"h-{node}",
        compute=1000.0,
        links=tuple(Link(p, 0.2 * MS, sent=s, resent=r) for p, (s, r) in links.items()),
    )


def mesh(n: int, loss: dict[str, float], noise: float = 0.0, seed: int = 0) -> list[NodeReport]:
    """n nodes, each pair probed by its later node; *loss*: a node's share of segments
    lost (either end's loss adds), *noise*: up to that share resent on any link."""
    rnd = random.Random(seed)
    names = [f"n{i}" for i in range(n)]
    out = []
    for i, a in enumerate(names):
        links = {}
        for b in names[:i]:
            share = loss.get(a, 0.0) + loss.get(b, 0.0) + rnd.uniform(0.0, noise)
            links[b] = (SENT, round(SENT * share))
        out.append(rep(a, links))
    return out


def out(reports: list[NodeReport]) -> list[str]:
    return [e.node for e in judge(reports, L)]


@pytest.mark.parametrize(
    ("n", "loss", "noise", "expected"),
    [
        (3, {}, 0.0, []),
        (8, {}, 0.0, []),
        # A busy, healthy network: spurious resends of up to 1.4 % on any link (the most
        # one healthy probe showed here): nobody is out, in any of these draws.
        *[(n, {}, 0.014, []) for n in (3, 4, 8)],
        # Everyone resends 5 %: a congested network, no node stands out.
        (4, {f"n{i}": 0.025 for i in range(4)}, 0.0, []),
        (3, {"n2": 0.05}, 0.0, ["n2"]),  # 5 % on every link of n2
        (3, {"n0": 0.05}, 0.005, ["n0"]),  # found through some noise, whoever probed
        (8, {"n5": 0.03}, 0.01, ["n5"]),
        (8, {"n1": 0.05, "n6": 0.1}, 0.0, ["n1", "n6"]),  # two lossy of eight
        (4, {"n3": 0.01}, 0.0, []),  # within the slack a healthy link may resend
        (2, {"n1": 0.2}, 0.0, []),  # one link: nothing to tell which end
    ],
)
def test_a_node_behind_a_lossy_interface_is_found(
    n: int, loss: dict[str, float], noise: float, expected: list[str]
) -> None:
    for seed in range(20):
        assert out(mesh(n, loss, noise, seed)) == expected, seed


def test_the_reason_names_the_loss() -> None:
    (e,) = judge(mesh(3, {"n2": 0.05}), L)
    (why,) = e.reasons
    assert why == (
        "its links lose packets: TCP resent 22 of 440 segments (5.0%) on its least lossy"
        " link, against 0.0% on its peers' (median)"
    )


def test_one_lossy_link_is_reported_and_excludes_nobody() -> None:
    reports = mesh(4, {})
    links = {lk.peer: (lk.sent, lk.resent) for lk in reports[3].links}
    links["n1"] = (SENT, 40)
    reports[3] = rep("n3", links)
    assert out(reports) == []
    (found,) = slow_links(reports, [], L)
    assert (
        found
        == "n1 <-> n3: TCP resent 40 of 440 segments (9.1%) (each end's least lossy link: 0.0%)"
    )
    assert slow_links(reports, ["n3"], L) == ()


def test_where_both_ends_counted_a_link_the_lower_count_stands() -> None:
    # n2's own probes say lossy; n0 and n1 probed n2 as well and saw it clean.
    reports = mesh(3, {"n2": 0.05})
    reports[0] = rep("n0", {"n2": (SENT, 0)})
    assert out(reports) == []


@pytest.mark.parametrize(
    ("sent", "resent"),
    [
        (0, 0),  # not counted (an old kernel, a cut-short probe)
        (99, 50),  # too few segments to tell
        (SENT, -5),
        (-SENT, -22),
        (SENT, SENT + 1),  # more resent than sent
        (SENT, math.nan),
        (math.nan, 22),
        (math.inf, 22),
        (SEGMENTS_LIMIT + 1, SEGMENTS_LIMIT),
        (10**30, 10**29),
    ],
)
def test_counts_no_probe_could_have_are_no_evidence(sent: float, resent: float) -> None:
    # The lossy node's own links carry the bad counts; its peers' link is clean. Built
    # directly (a struct's constructor does not validate), as a bug or a decoder could.
    bad = Link("n0", 0.2 * MS, sent=sent, resent=resent)  # type: ignore[arg-type]
    reports = mesh(3, {})
    reports[2] = msgspec.structs.replace(reports[2], links=(bad, bad, Link("n1", 0.2 * MS)))
    assert out(reports) == []
    assert slow_links(reports, [], L) == ()


@pytest.mark.parametrize(
    ("sent", "resent"),
    [(-1, 0), (SENT, -1), (SEGMENTS_LIMIT + 1, 0), (SENT, SEGMENTS_LIMIT + 1), (1.5, 0)],
)
def test_a_signed_report_with_impossible_counts_is_dropped(sent: float, resent: float) -> None:
    key = health_key(b"s" * 32, "job")
    raw = sign(key, rep("n0", {"n1": (sent, resent)})).encode()  # type: ignore[dict-item]
    with pytest.raises(BadRecord, match="not a report"):
        open_report(key, raw, "job", 0, "n0")
    # The same counts in range are read back as sent.
    raw = sign(key, rep("n0", {"n1": (SENT, 22)})).encode()
    assert open_report(key, raw, "job", 0, "n0").links[0] == Link("n1", 0.2 * MS, SENT, 22)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"\x00\x00\x01\xb8\x00\x00\x00\x16", probe.Segments(440, 22)),
        (b"\x00\x00\x00\x00\x00\x00\x00\x00", probe.Segments(0, 0)),
        (b"\x00\x00\x01\xb8\x00\x00\x01\xb9", None),  # more resent than sent
        (b"\xff\xff\xff\xff\x00\x00\x00\x00", None),  # more than any probe sends
        (b"\x00\x00\x01\xb8", None),  # short
        (b"\x00" * 4096, None),  # oversized
        (b"", None),
    ],
)
def test_the_servers_half_is_used_only_when_plausible(
    raw: bytes, expected: probe.Segments | None
) -> None:
    assert probe.counts_of(raw) == expected


@pytest.mark.parametrize(
    ("segments", "expected"),
    [
        (None, Link("p", 0.001)),
        (probe.Segments(440, 22), Link("p", 0.001, 440, 22)),
        (probe.Segments(SEGMENTS_LIMIT * 4, 30), Link("p", 0.001, SEGMENTS_LIMIT, 30)),
        (probe.Segments(10, 20), Link("p", 0.001, 10, 10)),
        (probe.Segments(-3, -1), Link("p", 0.001, 0, 0)),
    ],
)
def test_a_probe_is_clamped_to_what_a_report_may_carry(
    segments: probe.Segments | None, expected: Link
) -> None:
    from stalwart.health.admission import _link

    link = _link("p", probe.Echo(0.001, segments))
    assert link == expected
    key = health_key(b"s" * 32, "job")
    report = msgspec.structs.replace(rep("n0", {}), links=(link,))
    # Its own report always reads back: one out-of-range count would drop it whole.
    assert open_report(key, sign(key, report).encode(), "job", 0, "n0") == report


def test_a_lossy_member_voids_the_collective_checks_blame_of_the_others() -> None:
    """Seen at 5 % loss: the pair of a healthy node with the lossy one failed while the
    lossy one's other pair passed, so the split blamed the healthy node."""
    from stalwart.health.records import Blame, CollectiveLinks

    members = ("n0", "n1", "n2")
    said = CollectiveLinks(
        members=members, nodes=(Blame("n0", "a pair with it failed"), Blame("n2", "slow"))
    )
    lossy = [msgspec.structs.replace(r, collective=said) for r in mesh(3, {"n2": 0.05})]
    assert out(lossy) == ["n2"]
    assert judge(lossy, L)[0].reasons[1] == "slow"  # its own blame stands
    # Without loss anywhere, the members' word stands as before.
    clean = [msgspec.structs.replace(r, collective=said) for r in mesh(3, {})]
    assert out(clean) == ["n0", "n2"]
