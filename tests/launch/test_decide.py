"""The supervisor's next move after a round, as tables: no processes, no store."""

from __future__ import annotations

import signal

import pytest

from stalwart.launch.round.decide import (
    Ending,
    JobOver,
    Move,
    Restart,
    RoundOutcome,
    RoundView,
    State,
    Stop,
    decide,
    interrupted,
    not_needed,
    stop_grace,
)
from stalwart.rendezvous.api import (
    FailureRecord,
    NodeExcluded,
    NodeLost,
    ShutdownRequested,
    WorkerFailed,
)

W0 = WorkerFailed(node_rank=0, local_rank=1, rank=1, pid=10, exitcode=1, timestamp=5.0)
W1 = WorkerFailed(node_rank=1, local_rank=0, rank=2, pid=11, exitcode=-9, timestamp=4.0)
LOST = NodeLost(node_rank=2, host="h2", reason="node 2 (h2) lost: no keep-alive for 15.0s")
OUT = NodeExcluded(node_rank=1, host="h1", pid=12, reason="rank 2 asked to exclude node 1 (h1)")
HALT = ShutdownRequested(node_rank=1, host="h1", pid=13, reason="rank 3 asked to shut down")

R = RoundOutcome


def view(
    outcome: RoundOutcome,
    attempt: int = 0,
    budget: int = 3,
    records: tuple[FailureRecord, ...] = (),
    request: str = "",
) -> RoundView:
    return RoundView(outcome, attempt, budget, records, request)


def stop(
    ending: Ending,
    state: State,
    code: int,
    attempts: int,
    reason: str = "",
    tell: JobOver | None = None,
    workers: tuple[WorkerFailed, ...] = (),
    departed: tuple[NodeLost | NodeExcluded, ...] = (),
) -> Stop:
    return Stop(
        ending=ending,
        state=state,
        exit_code=code,
        attempts=attempts,
        reason=reason,
        tell=tell,
        workers=workers,
        departed=departed,
    )


SUCCESS = Ending.SUCCEEDED
OK, FAILED = State.SUCCEEDED, State.FAILED


@pytest.mark.parametrize(
    ("given", "want"),
    [
        # Success ends the job and tells the spares.
        (
            view(R.SUCCEEDED),
            stop(SUCCESS, OK, 0, 1, tell=JobOver(True, "succeeded in attempt 0")),
        ),
        (
            view(R.SUCCEEDED, attempt=3, budget=3),
            stop(SUCCESS, OK, 0, 4, tell=JobOver(True, "succeeded in attempt 3")),
        ),
        # A failure restarts while the budget lasts ...
        (
            view(R.LOCAL_FAILURE, records=(W0, W1)),
            Restart(0, restarts_left=2, reason="local_failure", workers=(W0, W1)),
        ),
        (
            view(R.PEER_FAILURE, attempt=2, records=(W1,)),
            Restart(2, restarts_left=0, reason="peer_failure", workers=(W1,)),
        ),
        # ... and nodes that left the job are named, whatever the kind of the others.
        (
            view(R.PEER_FAILURE, attempt=1, records=(LOST, W0, OUT)),
            Restart(1, 1, "peer_failure", workers=(W0,), departed=(LOST, OUT)),
        ),
        # A record-less failure (the store had none yet) still restarts.
        (view(R.LOCAL_FAILURE), Restart(0, 2, "local_failure")),
        # No restart left: the job fails.
        (
            view(R.LOCAL_FAILURE, attempt=3, budget=3, records=(W0, LOST)),
            stop(
                Ending.GAVE_UP,
                FAILED,
                1,
                4,
                tell=JobOver(False, "failed after 4 attempt(s)"),
                workers=(W0,),
                departed=(LOST,),
            ),
        ),
        (
            view(R.PEER_FAILURE, budget=0),
            stop(Ending.GAVE_UP, FAILED, 1, 1, tell=JobOver(False, "failed after 1 attempt(s)")),
        ),
        # This node's rank asked to shut down: the job stops, budget or not.
        (
            view(R.SHUTDOWN_REQUESTED, request="rank 0 asked", records=(HALT,)),
            stop(Ending.SHUT_DOWN, FAILED, 1, 1, "rank 0 asked", JobOver(False, "rank 0 asked")),
        ),
        (
            view(R.SHUTDOWN_REQUESTED, attempt=1),
            stop(Ending.SHUT_DOWN, FAILED, 1, 2, "shutdown", JobOver(False, "shutdown")),
        ),
        # A peer's rank asked: its reason, read from its record, wins over a worker's death.
        (
            view(R.PEER_FAILURE, records=(W0, HALT)),
            stop(Ending.SHUT_DOWN, FAILED, 1, 1, HALT.reason, JobOver(False, HALT.reason)),
        ),
        # Excluded: this node leaves, successfully, and the job goes on (no word to spares).
        (
            view(R.NODE_EXCLUDED, attempt=2, request=OUT.reason, records=(OUT,)),
            stop(Ending.EXCLUDED, OK, 0, 3, OUT.reason),
        ),
        # Another node excluded itself: a failure of the round like any other.
        (
            view(R.PEER_FAILURE, records=(OUT,)),
            Restart(0, 2, "peer_failure", departed=(OUT,)),
        ),
    ],
)
def test_decide(given: RoundView, want: Move) -> None:
    assert decide(given) == want


@pytest.mark.parametrize(
    ("sig", "attempt", "code", "attempts", "reason"),
    [
        (signal.SIGTERM, 0, 143, 1, "signal SIGTERM"),
        (signal.SIGINT, 2, 130, 3, "signal SIGINT"),
        (signal.SIGHUP, 0, 129, 1, "signal SIGHUP"),
    ],
)
def test_interrupted(sig: int, attempt: int, code: int, attempts: int, reason: str) -> None:
    assert interrupted(sig, attempt) == stop(
        Ending.INTERRUPTED, State.INTERRUPTED, code, attempts, reason
    )


@pytest.mark.parametrize(("succeeded", "code", "state"), [(True, 0, OK), (False, 1, FAILED)])
def test_a_spare_never_admitted_exits_as_the_job_did(
    succeeded: bool, code: int, state: State
) -> None:
    assert not_needed(succeeded, "done") == stop(Ending.NOT_NEEDED, state, code, 0, "done")


# (how the round ended, --shutdown-timeout, --survivor-grace) -> SIGTERM -> SIGKILL grace
_GRACES = [
    (R.LOCAL_FAILURE, 30.0, 5.0, 5.0),
    (R.PEER_FAILURE, 30.0, 5.0, 5.0),
    (R.LOCAL_FAILURE, 2.0, 5.0, 2.0),  # --shutdown-timeout bounds every grace
    (R.PEER_FAILURE, 30.0, 0.0, 0.0),
    (R.SHUTDOWN_REQUESTED, 30.0, 5.0, 30.0),  # a stop asked for keeps the full grace
    (R.NODE_EXCLUDED, 30.0, 5.0, 30.0),
    (R.SUCCEEDED, 30.0, 5.0, 30.0),
]


@pytest.mark.parametrize(("outcome", "shutdown", "survivor", "grace"), _GRACES)
def test_stop_grace(outcome: RoundOutcome, shutdown: float, survivor: float, grace: float) -> None:
    assert stop_grace(outcome, shutdown, survivor) == grace
