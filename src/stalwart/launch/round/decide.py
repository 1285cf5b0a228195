"""The supervisor's decisions, apart from its I/O: what a finished round leads to.

The supervisor joins a round, runs it, then asks ``decide`` for the next move from a
typed view of the round: how it ended, which attempt it was, the restart budget and
what every node reported.  The answer is a ``Restart`` or a ``Stop``; the supervisor
acts on it (events, console, rendezvous).  A signal (``interrupted``) and a spare the
job never needed (``not_needed``) end as a ``Stop`` too, so a ``JobResult`` is made from
a ``Stop`` in one place.  Everything here is pure, over plain records (no host name,
clock or file; the monitor's requests arrive as ``ControlAsk``): ``tests/launch/test_decide.py``
reads it as tables.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from enum import Enum

from stalwart.launch.round.restart_policy import Verdict
from stalwart.rendezvous.api import (
    FailureRecord,
    NodeExcluded,
    NodeLost,
    ShutdownRequested,
    WorkerFailed,
    membership_change,
)


class RoundOutcome(Enum):
    """How a round ended on this node."""

    SUCCEEDED = "succeeded"
    LOCAL_FAILURE = "local_failure"
    PEER_FAILURE = "peer_failure"
    SHUTDOWN_REQUESTED = "shutdown_requested"
    NODE_EXCLUDED = "node_excluded"
    NODES_WAITING = "nodes_waiting"  # ended to admit waiting nodes: the job grows


class State(Enum):
    """How the job ended for this node: the word of the closing summary."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


class Ending(Enum):
    """Why this node stops; each is acted on in its own way (event, console line)."""

    SUCCEEDED = "succeeded"  # every node's workers finished
    GAVE_UP = "gave_up"  # a failure with no restart left
    CRASH_LOOP = "crash_loop"  # a failure no restart can help (``restart_policy``)
    SHUT_DOWN = "shut_down"  # a rank asked to stop the job
    EXCLUDED = "excluded"  # a rank asked to take this node out; the job goes on
    QUARANTINED = "quarantined"  # it keeps failing (``health.quarantine``): kept out
    INTERRUPTED = "interrupted"  # a termination signal reached the launcher
    NOT_NEEDED = "not_needed"  # a spare: the job ended before admitting it


@dataclass(frozen=True)
class JobOver:
    """What the rendezvous is told, so that spares waiting to join stop too."""

    succeeded: bool
    reason: str
    exit_code: int | None = None  # every node exits with it (None: 0 or 1)


@dataclass(frozen=True)
class RoundView:
    """What ``decide`` reads about a finished round."""

    outcome: RoundOutcome
    attempt: int
    max_restarts: int
    # What the nodes reported for the round (none when it succeeded).
    records: tuple[FailureRecord, ...] = ()
    # Why this node's rank asked to stop the job or leave it ("" when none did).
    request: str = ""
    # The crash-loop verdict on the job's failed attempts so far, this one included.
    loop: Verdict | None = None


@dataclass(frozen=True)
class Restart:
    """Another attempt: the budget allows it."""

    attempt: int  # the attempt that failed
    restarts_left: int
    reason: str
    workers: tuple[WorkerFailed, ...] = ()  # the failed workers the nodes reported
    departed: tuple[NodeLost | NodeExcluded, ...] = ()  # nodes that left the job

    @property
    def next_attempt(self) -> int:
        return self.attempt + 1


@dataclass(frozen=True)
class Stop:
    """The job is over for this node."""

    ending: Ending
    state: State
    exit_code: int
    attempts: int  # how many attempts this node saw started (0: a spare never admitted)
    reason: str = ""
    tell: JobOver | None = None  # None: the job goes on, or has ended already
    workers: tuple[WorkerFailed, ...] = ()
    departed: tuple[NodeLost | NodeExcluded, ...] = ()


Move = Restart | Stop


def decide(view: RoundView) -> Move:
    """The next move after a round.

    A shutdown request (this node's, or one a peer reported) stops the job without
    restart; an exclusion of this node makes it leave while the others go on; success
    ends the job; any other failure restarts it while the budget lasts."""
    attempt = view.attempt
    outcome = view.outcome
    shutdown = next((r for r in view.records if isinstance(r, ShutdownRequested)), None)
    if outcome is RoundOutcome.SHUTDOWN_REQUESTED or (
        outcome is RoundOutcome.PEER_FAILURE and shutdown is not None
    ):
        reason = view.request or (shutdown.reason if shutdown else "") or "shutdown"
        return Stop(
            ending=Ending.SHUT_DOWN,
            state=State.FAILED,
            exit_code=1,
            attempts=attempt + 1,
            reason=reason,
            tell=JobOver(False, reason),
        )
    if outcome is RoundOutcome.NODE_EXCLUDED:
        return Stop(
            ending=Ending.EXCLUDED,
            state=State.SUCCEEDED,
            exit_code=0,
            attempts=attempt + 1,
            reason=view.request,
        )
    if outcome is RoundOutcome.SUCCEEDED:
        return Stop(
            ending=Ending.SUCCEEDED,
            state=State.SUCCEEDED,
            exit_code=0,
            attempts=attempt + 1,
            tell=JobOver(True, f"succeeded in attempt {attempt}"),
        )
    grow = outcome is RoundOutcome.NODES_WAITING or (
        outcome is RoundOutcome.PEER_FAILURE and membership_change(view.records)
    )
    # `grows` only ends a round while the budget lasts, so this is a restart; the
    # budget check stays (a stranger's forged record must not buy one more round).
    if grow and attempt < view.max_restarts:
        return Restart(
            attempt=attempt,
            restarts_left=view.max_restarts - attempt - 1,
            reason=RoundOutcome.NODES_WAITING.value,
        )
    workers = tuple(r for r in view.records if isinstance(r, WorkerFailed))
    departed = tuple(r for r in view.records if isinstance(r, NodeLost | NodeExcluded))
    if view.loop is not None:
        # Before the budget: even the last attempt's end says "do not requeue".
        line = view.loop.line()
        return Stop(
            ending=Ending.CRASH_LOOP,
            state=State.FAILED,
            exit_code=view.loop.exit_code,
            attempts=attempt + 1,
            reason=line,
            tell=JobOver(False, line, view.loop.exit_code),
            workers=workers,
            departed=departed,
        )
    if attempt >= view.max_restarts:
        return Stop(
            ending=Ending.GAVE_UP,
            state=State.FAILED,
            exit_code=1,
            attempts=attempt + 1,
            tell=JobOver(False, f"failed after {attempt + 1} attempt(s)"),
            workers=workers,
            departed=departed,
        )
    return Restart(
        attempt=attempt,
        restarts_left=view.max_restarts - attempt - 1,
        reason=outcome.value,
        workers=workers,
        departed=departed,
    )


def grows(elastic: bool, waiting: int, attempt: int, max_restarts: int) -> bool:
    """Whether a running round ends to admit *waiting* nodes (the rendezvous counts only
    those the job has room for).  Each round is an attempt of the job's budget
    (``--max-restarts``), so the job grows only while a restart is left: the last attempt
    keeps running at its size, and the waiting nodes stay spares."""
    return elastic and waiting > 0 and attempt < max_restarts


def interrupted(sig: int, attempt: int) -> Stop:
    """A termination signal stops the job on this node, exiting as a shell would."""
    return Stop(
        ending=Ending.INTERRUPTED,
        state=State.INTERRUPTED,
        exit_code=128 + sig,
        attempts=attempt + 1,
        reason=f"signal {signal.Signals(sig).name}",
    )


def quarantined(line: str, goes_on: bool, attempts: int) -> Stop:
    """This node is quarantined before it joins another round: it leaves while the job
    goes on without it (exit 0, as an excluded node), or, when the job cannot, the job
    stops with *line* on every node."""
    if goes_on:
        return Stop(Ending.QUARANTINED, State.SUCCEEDED, 0, attempts, reason=line)
    return Stop(
        Ending.QUARANTINED, State.FAILED, 1, attempts, reason=line, tell=JobOver(False, line)
    )


def not_needed(succeeded: bool, reason: str, exit_code: int | None = None) -> Stop:
    """A node the job ended without (a spare, or a peer of a node that stopped a crash
    loop): it exits as the job did."""
    code = exit_code if exit_code is not None else 0 if succeeded else 1
    return Stop(
        ending=Ending.NOT_NEEDED,
        state=State.SUCCEEDED if succeeded else State.FAILED,
        exit_code=code,
        attempts=0,
        reason=reason,
    )


class Asked(Enum):
    """What a rank's control request asks of the round (the values are the monitor's
    ``ControlAction``'s, which the supervisor translates at its edge)."""

    CONTINUE = "continue"
    EXCLUDE_NODE = "exclude_node"
    SHUTDOWN_WORKLOAD = "shutdown_workload"


@dataclass(frozen=True)
class ControlAsk:
    """A rank's control request as the decisions read it."""

    action: Asked
    rank: int | None  # the asking rank's global rank, when known
    reason: str = ""  # set when the monitor asked on the rank's behalf


def control_outcome(action: Asked, elastic: bool) -> RoundOutcome | None:
    """What a rank's control request does to the round.  Excluding a node needs a
    membership that can lose one (elastic ``MIN:MAX``); with fixed membership the job
    cannot go on without the node, so the request ends the job as a shutdown does."""
    if action is Asked.SHUTDOWN_WORKLOAD:
        return RoundOutcome.SHUTDOWN_REQUESTED
    if action is Asked.EXCLUDE_NODE:
        return RoundOutcome.NODE_EXCLUDED if elastic else RoundOutcome.SHUTDOWN_REQUESTED
    return None


def control_reason(ask: ControlAsk, outcome: RoundOutcome, node_rank: int, host: str) -> str:
    """The one line a control request ends up as (events, the console, the peers);
    *host* is this node's name."""
    who = f"rank {ask.rank if ask.rank is not None else '?'}"
    if ask.reason and outcome is RoundOutcome.NODE_EXCLUDED:  # the monitor asked for it
        return f"{ask.reason}: excluding node {node_rank} ({host})"
    if ask.action is Asked.SHUTDOWN_WORKLOAD:
        return f"{who} asked to shut the workload down"
    if outcome is RoundOutcome.NODE_EXCLUDED:
        return f"{who} asked to exclude node {node_rank} ({host})"
    return (
        f"{who} asked to exclude node {node_rank}, and a job of fixed membership cannot go "
        "on without it (exclusion needs elastic --nnodes MIN:MAX)"
    )


def stop_grace(outcome: RoundOutcome, shutdown_timeout: float, survivor_grace: float) -> float:
    """Seconds between SIGTERM and SIGKILL for the workers still running when a round
    ends this way.  Survivors of a failure (here or on another node) get the shorter
    ``survivor_grace``; a job asked to stop, or a node leaving, the full
    ``shutdown_timeout``, which also bounds the former."""
    if outcome in (RoundOutcome.LOCAL_FAILURE, RoundOutcome.PEER_FAILURE):
        return min(survivor_grace, shutdown_timeout)
    return shutdown_timeout
