"""The elastic round's close rule: when an open round closes, and with whom.

A pure function of a `CloseView` (what a node reads of the store and the keep-alives)
and the job's `ElasticSettings`; `elastic.ElasticRendezvous` reads the view and acts on
the answer. ``tests/rendezvous/test_close_rule.py`` reads the rule as a table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ElasticSettings:
    min_nodes: int
    max_nodes: int
    max_restarts: int
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0  # how long the c10d store's host waits for others to leave
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3

    @property
    def lost_after(self) -> float:
        return self.keep_alive_interval * self.keep_alive_max_attempt


@dataclass(frozen=True)
class Joiner:
    """A node that took a slot in the round, as this node sees it now."""

    slot: int
    id: str
    hint: int | None  # previous group rank, or --node-rank
    alive: bool = True  # its keep-alive counter moves
    left: bool = False  # it said it left the job
    refused: bool = False  # the admission gate keeps it out of this round (health)
    pending: bool = False  # the gate has not decided yet (its report is still due)


@dataclass(frozen=True)
class CloseView:
    """What the close rule reads about an open round."""

    # The previous round still runs: whoever joins now is a spare for the next restart.
    previous_running: bool
    joiners: tuple[Joiner, ...] = ()
    # Ids of the previous round's members still alive and in the job (None: round 0).
    expected: frozenset[str] | None = None
    quiet_for: float = 0.0  # seconds since the last node joined (or the round opened)
    open_for: float = 0.0  # seconds since the round opened


@dataclass(frozen=True)
class Wait:
    """Not yet: look again shortly."""


@dataclass(frozen=True)
class WatchRunning:
    """Wait as a spare, watching the running round's nodes (if all of them die without
    a word, someone must fail that round, or the spares would wait forever)."""


@dataclass(frozen=True)
class Close:
    """Close the round with these slots, in rank order."""

    slots: tuple[int, ...]


@dataclass(frozen=True)
class TimedOut:
    """Too few nodes joined within the join timeout: the job cannot form."""

    live: int


@dataclass(frozen=True)
class TooFewAdmitted:
    """The round would close, but the gate keeps out so many joiners that fewer than MIN
    remain: the job cannot form without them."""

    admitted: int
    refused: tuple[str, ...]


CloseAction = Wait | WatchRunning | Close | TimedOut | TooFewAdmitted


def admissible_spares(
    running: frozenset[str], spares: tuple[Joiner, ...], s: ElasticSettings
) -> int:
    """How many of the nodes waiting for the next round it would admit beside the
    *running* round's nodes (ids), were the running round to end now: the live ones the
    gate lets in and that are not running already, up to MAX.  Positive: ending the
    round grows the job.  A spare whose health report is still due (pending) does not
    count yet: ending the round for it could only restart the job at the same size."""
    ids = {j.id for j in spares if j.alive and not j.left and not j.refused and not j.pending}
    return max(0, min(len(ids - running), s.max_nodes - len(running)))


def close_rule(view: CloseView, s: ElasticSettings) -> CloseAction:
    """Whether an open round closes now, and with whom.

    It closes once the previous round is over and, among the live joiners, either MAX
    are there, or at least MIN and every live member of the previous round is back, or
    at least MIN and nobody new arrived for ``last_call_timeout``.  Survivors keep their
    order (their hint), newcomers follow in order of arrival; beyond MAX, spares.  A
    joiner the admission gate refuses counts for nothing; when the round would close
    but for the refused, and fewer than MIN remain, it cannot form (`TooFewAdmitted`).
    While a joiner is pending (its health report is still due) the round closes only
    with MAX admitted."""
    if view.previous_running:
        return WatchRunning()
    live = [j for j in view.joiners if j.alive and not j.left]
    # A refused joiner neither counts nor is waited for (it is not coming in); a pending
    # one does not count yet, and is waited for (the gate bounds how long).
    ok = [j for j in live if not j.refused and not j.pending]
    out = {j.id for j in live if j.refused}
    waiting = any(j.pending for j in live)
    back = view.expected is not None and (view.expected - out) <= {j.id for j in ok}
    # Every place is taken (the refused and pending included): nobody else is on the way.
    full = len(live) >= s.max_nodes
    ready = not waiting and (back or full or view.quiet_for >= s.last_call_timeout)
    if len(ok) >= s.max_nodes or (len(ok) >= s.min_nodes and ready):
        ranked = sorted(ok, key=lambda j: (j.hint is None, j.hint or 0, j.slot))
        return Close(tuple(j.slot for j in ranked[: s.max_nodes]))
    if out and not waiting and (full or (len(live) >= s.min_nodes and ready)):
        return TooFewAdmitted(len(ok), tuple(j.id for j in live if j.refused))
    if view.open_for > s.join_timeout:
        return TimedOut(len(live))
    return Wait()
