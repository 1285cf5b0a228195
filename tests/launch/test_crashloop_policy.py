"""The crash-loop verdict as tables: pure functions over failure records, no processes."""

from __future__ import annotations

import pytest

from stalwart.launch.round.decide import Ending, RoundOutcome, RoundView, Stop, decide, not_needed
from stalwart.launch.round.restart_policy import (
    AttemptEnd,
    Cause,
    LoopPolicy,
    cause_of,
    progressed,
    verdict,
)
from stalwart.rendezvous.api import (
    FailureRecord,
    NodeExcluded,
    NodeLost,
    ShutdownRequested,
    WorkerFailed,
)

LR = "ValueError: config key 'lr' missing"


def worker(
    rank: int = 1,
    message: str = LR,
    exitcode: int = 1,
    sig: str | None = None,
    at: float = 1.0,
    reason: str = "",
) -> WorkerFailed:
    return WorkerFailed(
        node_rank=0,
        local_rank=rank,
        rank=rank,
        exitcode=exitcode,
        signal=sig,
        timestamp=at,
        message=message,
        reason=reason,
    )


CAUSE = Cause(1, "exit code 1", LR)


@pytest.mark.parametrize(
    ("records", "want"),
    [
        # The program's own faults.
        ([worker()], CAUSE),
        ([worker(message="")], Cause(1, "exit code 1", "")),
        ([worker(exitcode=-11, sig="SIGSEGV", message="")], Cause(1, "signal SIGSEGV", "")),
        ([worker(exitcode=-6, sig="SIGABRT", message="")], Cause(1, "signal SIGABRT", "")),
        ([worker(message="SystemExit: 2", exitcode=2)], Cause(1, "exit code 2", "SystemExit: 2")),
        # The earliest failure of every node's reports is the root cause.
        (
            [worker(0, "RuntimeError: peer gone", at=2.0), worker(1, at=1.0)],
            CAUSE,
        ),
        # Never the program's fault: nothing, a clean exit, a signal from outside.
        ([], None),
        ([worker(exitcode=0, message="")], None),
        ([worker(exitcode=-9, sig="SIGKILL", message="")], None),
        ([worker(exitcode=-15, sig="SIGTERM", message="")], None),
        ([worker(exitcode=-2, sig="SIGINT", message="KeyboardInterrupt")], None),
        # A hang the supervisor explained.
        ([worker(exitcode=-6, sig="SIGABRT", reason="hang: heartbeat timeout 2.0 s")], None),
        # Communication errors, by type or by words.
        ([worker(message="torch.distributed.DistBackendError: NCCL error")], None),
        ([worker(message="ConnectionResetError: [Errno 104] reset by peer")], None),
        ([worker(message="RuntimeError: [gloo/pair.cc:534] Connection closed by peer")], None),
        ([worker(message="TimeoutError: store get")], None),
        ([worker(message="RuntimeError: Socket Timeout")], None),
        # A node lost, excluded, or a shutdown asked for: the round's end is not the
        # program's, even with a worker failure beside it.
        ([worker(), NodeLost(node_rank=1, reason="lost")], None),
        ([worker(), NodeExcluded(node_rank=1)], None),
        ([ShutdownRequested(node_rank=0)], None),
    ],
)
def test_cause_of(records: list[FailureRecord], want: Cause | None) -> None:
    assert cause_of(records) == want


def end(
    attempt: int, cause: Cause | None = CAUSE, step: int | None = None, ckpt: int | None = None
) -> AttemptEnd:
    return AttemptEnd(attempt, cause, step, ckpt)


OTHER = Cause(1, "exit code 1", "KeyError: 'x'")
RANK0 = Cause(0, "exit code 1", LR)
K3 = LoopPolicy(attempts=3, exit_code=93)


@pytest.mark.parametrize(
    ("history", "stops_after"),
    [
        # Start-up crashes, the same every time: the third one stops.
        ([end(0)], None),
        ([end(0), end(1)], None),
        ([end(0), end(1), end(2)], (0, 1, 2)),
        # The same cause, but each attempt gets further: never.
        ([end(0, step=5), end(1, step=9), end(2, step=14)], None),
        ([end(0, step=5), end(1, step=9), end(2, step=14), end(3, step=20)], None),
        # Further by a committed checkpoint only: progress too.
        ([end(0, ckpt=10), end(1, ckpt=20), end(2, ckpt=30)], None),
        # Progress in the first attempt only: the streak starts after it.
        ([end(0, step=50), end(1, step=30), end(2, step=30)], None),
        ([end(0, step=50), end(1, step=30), end(2, step=30), end(3, step=50)], (1, 2, 3)),
        # A different cause breaks the streak; so does one that is not deterministic.
        ([end(0), end(1, OTHER), end(2), end(3)], None),
        ([end(0), end(1, OTHER), end(2), end(3), end(4)], (2, 3, 4)),
        ([end(0), end(1, None), end(2)], None),
        ([end(0), end(1), end(2, None)], None),
        # Another rank with the same message is another cause.
        ([end(0), end(1, RANK0), end(2)], None),
        # Progress in the middle of the streak breaks it.
        ([end(0), end(1, step=3), end(2)], None),
    ],
)
def test_verdict_table(history: list[AttemptEnd], stops_after: tuple[int, ...] | None) -> None:
    got = verdict(history, K3)
    if stops_after is None:
        assert got is None
    else:
        assert got is not None and got.attempts == stops_after and got.exit_code == 93
        assert not got.at_once


def test_k_and_zero() -> None:
    two = [end(0), end(1)]
    assert verdict(two, LoopPolicy(attempts=2)) is not None
    assert verdict(two, LoopPolicy(attempts=3)) is None
    assert verdict([end(i) for i in range(20)], LoopPolicy(attempts=0)) is None
    assert verdict([end(0)], LoopPolicy(attempts=1)) is not None
    assert verdict([], K3) is None


@pytest.mark.parametrize(
    ("error", "stop_on", "step", "at_once"),
    [
        ("ImportError: cannot import name 'x'", ("ImportError",), None, True),
        # A subclass of a built-in named: ModuleNotFoundError is an ImportError.
        ("ModuleNotFoundError: No module named 'x'", ("ImportError",), None, True),
        (
            "SyntaxError: invalid syntax (train.py, line 3)",
            ("ImportError", "SyntaxError"),
            None,
            True,
        ),
        ("IndentationError: unexpected indent", ("SyntaxError",), None, True),
        # A project's own exception, by name or dotted path.
        ("mylib.errors.ConfigError: no lr", ("ConfigError",), None, True),
        ("mylib.errors.ConfigError: no lr", ("mylib.errors.ConfigError",), None, True),
        # After the first step: the list does not apply.
        ("ImportError: late import", ("ImportError",), 0, False),
        # Not in the list, nor a subclass of what is.
        ("ValueError: x", ("ImportError",), None, False),
        ("ImportError: x", ("ModuleNotFoundError",), None, False),
        ("ImportError: x", (), None, False),
        # Names that are not exception classes match by name only.
        ("ValueError: x", ("print",), None, False),
        ("", ("ImportError",), None, False),
        ("not a type at all", ("ImportError",), None, False),
    ],
)
def test_stop_on(error: str, stop_on: tuple[str, ...], step: int | None, at_once: bool) -> None:
    cause = Cause(0, "exit code 1", error)
    got = verdict([end(0, cause, step=step)], LoopPolicy(attempts=0, stop_on=stop_on, exit_code=77))
    assert (got is not None and got.at_once and got.exit_code == 77) == at_once


def test_progressed_compares_with_every_attempt_before() -> None:
    h = [end(0, step=10), end(1, step=4), end(2, step=8), end(3, step=11)]
    assert [progressed(h, i) for i in range(4)] == [True, False, False, True]
    assert progressed([end(0)], 0) is False
    assert progressed([end(0, ckpt=0)], 0) is True


def test_the_verdict_line_names_the_cause_and_the_code() -> None:
    v = verdict([end(0), end(1), end(2)], K3)
    assert v is not None
    line = v.line()
    assert "rank 1" in line and LR in line and "(0, 1, 2)" in line
    assert "exit code 93" in line and "do not requeue" in line


def test_an_oversized_message_is_cut_in_the_line() -> None:
    huge = "ValueError: " + "x" * 1_000_000
    v = verdict([end(i, Cause(1, "exit code 1", huge)) for i in range(3)], K3)
    assert v is not None and len(v.line()) < 400


def test_hostile_type_names_do_not_reach_the_builtins() -> None:
    # A message is the worker's to write: a name that is a built-in but not an
    # exception class, or garbage, never matches a --stop-on entry by subclass.
    for error in (
        "__import__: x",
        "object: x",
        "type: x",
        "\x00ImportError: x",
        "ImportError" * 10_000,
    ):
        got = verdict([end(0, Cause(0, "exit code 1", error))], LoopPolicy(0, ("ImportError",)))
        assert got is None or error.startswith("ImportError")


def _failed(attempt: int, loop: bool) -> RoundView:
    v = verdict([end(i) for i in range(attempt + 1)], K3) if loop else None
    return RoundView(RoundOutcome.LOCAL_FAILURE, attempt, 5, (worker(),), loop=v)


def test_decide_stops_a_crash_loop_before_the_budget_is_spent() -> None:
    move = decide(_failed(2, loop=True))
    assert isinstance(move, Stop) and move.ending is Ending.CRASH_LOOP
    assert move.exit_code == 93 and move.attempts == 3
    assert move.tell is not None and move.tell.exit_code == 93 and not move.tell.succeeded
    assert move.workers == (worker(),)


def test_decide_without_a_verdict_restarts_as_before() -> None:
    move = decide(_failed(2, loop=False))
    assert not isinstance(move, Stop) and move.restarts_left == 2


def test_a_peer_that_was_told_exits_with_the_same_code() -> None:
    assert not_needed(False, "crash loop", 93).exit_code == 93
    assert not_needed(False, "gave up").exit_code == 1
    assert not_needed(True, "done").exit_code == 0
