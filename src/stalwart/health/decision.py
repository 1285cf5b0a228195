"""Whether one joiner may join a round: the one admission decision.

Three things can keep a node out, and each has its own source: its own checks and how
it compares with its peers (the reports and ``judge``), its standing in the job's
quarantine ledger (``quarantine.standing``), and silence (it took its place in the
round but left no report within the bound). ``admission`` composes them for one
joiner; the gate asks it for every joiner of an open round and writes the answers into
the round's verdict, so every node logs the same exclusions through one event path.
Pure: ``tests/health/test_health_decision.py`` reads it as a table.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.health.records import MAX_PROBLEMS, By, NodeReport


@dataclass(frozen=True)
class Candidate:
    """One joiner of an open round, as the node about to close it sees it."""

    node: str
    # Its signed report for the round; None: none yet (or none that was valid). One not
    # ``final`` yet (its links are being timed) is waited for like a missing one.
    report: NodeReport | None
    # Seconds since this node first saw it joined without a report.
    silent_for: float
    # What comparing it with its peers found (slow compute, slow links).
    against_peers: tuple[str, ...] = ()
    # Its quarantine's one line while it is quarantined; None: it is not.
    quarantine: str | None = None


@dataclass(frozen=True)
class Admit:
    pass


@dataclass(frozen=True)
class Pending:
    """No report yet, within the bound: the round waits for it."""


@dataclass(frozen=True)
class Refuse:
    by: By
    reasons: tuple[str, ...]


Admission = Admit | Pending | Refuse


def admission(c: Candidate, *, checks: bool, wait: float) -> Admission:
    """Whether *c* joins the round.

    *checks*: the job runs health checks (a node then owes a report); off, only the
    quarantine decides. *wait*: seconds a joiner may stay silent before it is refused.
    A quarantine comes first: a node that may not join whatever its checks say is not
    waited for either."""
    if c.quarantine is not None:
        return Refuse(By.QUARANTINE, (c.quarantine,))
    if not checks:
        return Admit()
    if c.report is None or not c.report.final:
        if c.silent_for < wait:
            return Pending()
        what = "health report" if c.report is None else "complete health report (links)"
        return Refuse(By.NO_REPORT, (f"no {what} within {wait:g}s of joining",))
    reasons = (*c.report.problems, *c.against_peers)[:MAX_PROBLEMS]
    return Refuse(By.HEALTH_CHECK, reasons) if reasons else Admit()
