"""The one admission decision as a table: a joiner's quarantine standing, its own
report, what its peers' comparison found, and its silence -> admit, wait, or refuse
with the reason and what refused it. No store, no process, no clock."""

from __future__ import annotations

import pytest

from stalwart.health.decision import Admission, Admit, Candidate, Pending, Refuse, admission
from stalwart.health.records import By, NodeReport

WAIT = 20.0


def rep(*problems: str, final: bool = True) -> NodeReport:
    return NodeReport(run_id="job", round=0, node="n1", host="h1", problems=problems, final=final)


def c(
    report: NodeReport | None = None,
    silent: float = 0.0,
    peers: tuple[str, ...] = (),
    quarantine: str | None = None,
) -> Candidate:
    return Candidate("n1", report, silent, peers, quarantine)


Q = "node n1 is quarantined for the rest of the job: implicated in 3 of the last 5"
SLOW = "compute 10 products/s is 8% of its peers' median 120 (below 30%)"


@pytest.mark.parametrize(
    ("cand", "checks", "want"),
    [
        # A clean report: in.
        (c(rep()), True, Admit()),
        # Its own problem, its pace against its peers', or both (its own first).
        (c(rep("disk full")), True, Refuse(By.HEALTH_CHECK, ("disk full",))),
        (c(rep(), peers=(SLOW,)), True, Refuse(By.HEALTH_CHECK, (SLOW,))),
        (c(rep("disk full"), peers=(SLOW,)), True, Refuse(By.HEALTH_CHECK, ("disk full", SLOW))),
        # No report yet: waited for, up to the bound; then out, saying how long.
        (c(None, silent=0.0), True, Pending()),
        (c(None, silent=WAIT - 0.01), True, Pending()),
        (c(None, silent=WAIT), True, Refuse(By.NO_REPORT, ("no health report within 20s of joining",))),
        # A report whose links are still being timed: waited for like a missing one.
        (c(rep(final=False), silent=WAIT - 0.01), True, Pending()),
        (c(rep("disk full", final=False), silent=0.0), True, Pending()),
        (c(rep(final=False), silent=WAIT), True,
         Refuse(By.NO_REPORT, ("no complete health report (links) within 20s of joining",))),
        # A quarantine wins over everything, and is not waited for.
        (c(rep(), quarantine=Q), True, Refuse(By.QUARANTINE, (Q,))),
        (c(rep("disk full"), quarantine=Q), True, Refuse(By.QUARANTINE, (Q,))),
        (c(None, silent=0.0, quarantine=Q), True, Refuse(By.QUARANTINE, (Q,))),
        # Checks off (quarantine only): nobody owes a report.
        (c(None, silent=1e9), False, Admit()),
        (c(None, quarantine=Q), False, Refuse(By.QUARANTINE, (Q,))),
    ],
)  # fmt: skip
def test_admission(cand: Candidate, checks: bool, want: Admission) -> None:
    assert admission(cand, checks=checks, wait=WAIT) == want


def test_a_report_with_too_many_reasons_is_clipped_to_what_a_verdict_holds() -> None:
    got = admission(c(rep(*(f"p{i}" for i in range(8))), peers=(SLOW,)), checks=True, wait=WAIT)
    assert isinstance(got, Refuse) and len(got.reasons) == 8 and SLOW not in got.reasons
