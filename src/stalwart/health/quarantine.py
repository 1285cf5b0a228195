"""Which nodes are kept out of the job's later rounds, and until when.

After every failed round each node writes down which node the round's end points at
(``implicate``): the node of the root-cause worker, of a hang's root, of a node that
asked out (a straggler verdict, a rank's request) or that was lost.  ``standing``
reads that ledger: a node implicated in K of the last M failed rounds is quarantined,
for a while or for the rest of the job.  ``withdrawal`` says whether the job can go on
without it.  All pure, over plain records: ``tests/health/test_quarantine_table.py``
reads them as tables; ``ledger`` and the supervisor do the I/O.

Blame needs a comparison: a round of a single node implicates nobody (every failure of
a one-node job lands on its only node), though it still takes a place in the window.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec

from stalwart.rendezvous.api import (
    FailureRecord,
    NodeExcluded,
    NodeLost,
    ShutdownRequested,
    WorkerFailed,
)

#: The longest node name and reason a ledger entry may carry (characters).
NODE_LIMIT = 300
REASON_LIMIT = 512


class Cause(enum.StrEnum):
    """How a failed round points at a node."""

    FAILED = "failed"  # its worker failed first (the root cause)
    HUNG = "hung"  # its worker was the root of a hang
    EXCLUDED = "excluded"  # it asked to leave (a straggler verdict, a rank's request)
    LOST = "lost"  # it stopped beating


class Implication(msgspec.Struct, frozen=True, kw_only=True):
    """One failed round in the job's ledger: which node its end points at ("" for none)."""

    round: Annotated[int, msgspec.Meta(ge=0)]
    node: Annotated[str, msgspec.Meta(max_length=NODE_LIMIT)]
    cause: Cause
    nodes: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]  # how many nodes the round had
    at: Annotated[float, msgspec.Meta(ge=0, le=1e11)]  # the writer's wall clock (seconds)
    reason: Annotated[str, msgspec.Meta(max_length=REASON_LIMIT)] = ""


@dataclass(frozen=True)
class Policy:
    """``--quarantine-after K/M`` and ``--quarantine-for``."""

    after: int  # K: implicated in this many ...
    window: int  # M: ... of the job's last this many failed rounds
    hold: float | None  # seconds until it may rejoin; None: never (the rest of the job)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def implicate(
    records: Sequence[FailureRecord], nodes: Sequence[str], round_: int, at: float
) -> Implication | None:
    """The ledger entry of failed round *round_*, from what its nodes reported;
    *nodes* names the round's nodes by node rank.  None when nothing failed or a rank
    asked to stop the job (no node is at fault for that)."""
    if not records or any(isinstance(r, ShutdownRequested) for r in records):
        return None
    cause: Cause
    excluded = [r for r in records if isinstance(r, NodeExcluded)]
    lost = [r for r in records if isinstance(r, NodeLost)]
    workers = [r for r in records if isinstance(r, WorkerFailed)]
    if excluded:
        root: FailureRecord = min(excluded, key=lambda r: r.node_rank)
        cause = Cause.EXCLUDED
    elif lost:
        # A lost node's peers fail next (connection reset): the loss is the cause.
        root = min(lost, key=lambda r: r.node_rank)
        cause = Cause.LOST
    elif workers:
        first = min(workers, key=lambda w: (w.timestamp, w.node_rank))
        root = first
        # A worker record carries a reason only when the monitor judged it hung.
        cause = Cause.HUNG if first.reason else Cause.FAILED
    else:
        return None
    name = nodes[root.node_rank] if root.node_rank < len(nodes) else ""
    detail = root.reason
    if not detail and isinstance(root, WorkerFailed):
        rank = "?" if root.rank is None else root.rank
        how = f"signal {root.signal}" if root.signal else f"exit code {root.exitcode}"
        detail = f"rank {rank} {how}"
    return Implication(
        round=round_,
        node=_clip(name, NODE_LIMIT),
        cause=cause,
        nodes=max(1, len(nodes)),
        at=max(0.0, at),
        reason=_clip(detail, REASON_LIMIT),
    )


@dataclass(frozen=True)
class Quarantine:
    """A node kept out of the job's rounds."""

    node: str
    round: int  # the failed round that made it so
    at: float  # when that round's entry was written (wall clock)
    until: float | None  # when it may rejoin (None: never)
    count: int  # K reached: in this many ...
    window: int  # ... of the last this many failed rounds
    causes: tuple[Cause, ...]  # how each of those rounds pointed at it, oldest first

    def line(self) -> str:
        """The one line events, the console and the summary give."""
        why = ", ".join(c.value for c in self.causes)
        until = "for the rest of the job" if self.until is None else "for a while"
        return (
            f"node {self.node} is quarantined {until}: implicated in {self.count} of the "
            f"last {self.window} failed rounds (round {self.round}; {why})"
        )


@dataclass(frozen=True)
class Standing:
    """The ledger's verdict at one moment."""

    active: tuple[Quarantine, ...] = ()
    released: tuple[Quarantine, ...] = ()  # quarantines whose time is up

    def of(self, node: str) -> Quarantine | None:
        return next((q for q in self.active if q.node == node), None)


def standing(ledger: Sequence[Implication], policy: Policy, now: float) -> Standing:
    """Who is quarantined at wall-clock time *now*.

    The ledger is read in round order (one entry per round, the first for a round
    wins).  At each failed round the window is the last M failed rounds, that one
    included; a node named in at least K of them (in rounds of two nodes or more) is
    quarantined from that round on.  When its time is up it is released, and what it
    was blamed for before is forgiven (it starts again from zero); the writers' and
    this node's clocks are taken to agree to within the hold's precision."""
    entries: dict[int, Implication] = {}
    for e in ledger:
        entries.setdefault(e.round, e)
    ordered = [entries[r] for r in sorted(entries)]
    active: dict[str, Quarantine] = {}
    released: list[Quarantine] = []
    forgiven: dict[str, int] = {}  # node -> the last round forgiven

    def release(t: float, last_round: int) -> None:
        for node, q in list(active.items()):
            if q.until is not None and q.until <= t:
                del active[node]
                released.append(q)
                forgiven[node] = last_round

    for i, e in enumerate(ordered):
        release(e.at, e.round - 1)
        if not e.node or e.nodes < 2 or e.node in active:
            continue
        window = ordered[max(0, i - policy.window + 1) : i + 1]
        mine = [
            w
            for w in window
            if w.node == e.node and w.nodes >= 2 and w.round > forgiven.get(e.node, -1)
        ]
        if len(mine) >= policy.after:
            until = None if policy.hold is None else e.at + policy.hold
            active[e.node] = Quarantine(
                e.node, e.round, e.at, until, len(mine), policy.window, tuple(w.cause for w in mine)
            )
    release(now, ordered[-1].round if ordered else -1)
    return Standing(tuple(active.values()), tuple(released))


@dataclass(frozen=True)
class Withdrawal:
    """What a quarantined node does: leave while the others go on, or end the job."""

    goes_on: bool
    line: str


def withdrawal(q: Quarantine, *, elastic: bool, others: int, min_nodes: int) -> Withdrawal:
    """Whether the job can go on without quarantined node *q*: only an elastic job
    (``--nnodes MIN:MAX``) with at least MIN other nodes still in it (spares count)."""
    if not elastic:
        return Withdrawal(
            False,
            f"{q.line()}; a job of fixed membership cannot go on without it (quarantine "
            "needs elastic --nnodes MIN:MAX to go on)",
        )
    if others < min_nodes:
        return Withdrawal(
            False,
            f"{q.line()}; {others} other node(s) remain, fewer than the {min_nodes} the job needs",
        )
    return Withdrawal(True, f"{q.line()}; the job goes on with the other {others} node(s)")
