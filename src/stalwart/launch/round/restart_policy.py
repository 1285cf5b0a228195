"""Whether another restart can help: the crash-loop verdict, beside ``decide``.

A restart costs every node a fresh start (imports, rendezvous, warm-up), and a scheduler
that sees the job fail requeues it to fail again.  When the same fault ends attempt after
attempt and the job gets no further than it got before, restarting only burns the
budget: the job stops with a verdict naming the cause and an exit code that tells the
scheduler not to requeue (93 by default, as NVIDIA's ft_launcher).

Only a fault the program makes by itself counts: an exception it raised, an exit code,
a signal it brought on itself (SIGSEGV, SIGABRT...).  A hang, a lost or excluded node,
a signal sent from outside (SIGKILL from the OOM killer, SIGTERM from a scheduler) and a
communication error are circumstances that the next attempt may not meet, so they never
count and they break a streak.  Pure: ``tests/launch/test_restart_policy.py`` reads it
as tables.
"""

from __future__ import annotations

import builtins
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from stalwart.rendezvous.api import FailureRecord, WorkerFailed

# Signals a process raises on itself by what it runs; every other one came from outside.
_SELF_INFLICTED = frozenset(
    s.name for s in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)
) | {"SIGSYS", "SIGTRAP"}

# The exception types torch and Python raise when a peer, the store or the network
# failed: the fault is elsewhere, or passing.
_COMMUNICATION_TYPES = frozenset(
    {
        "DistError",
        "DistBackendError",
        "DistNetworkError",
        "DistStoreError",
        "DistQueueEmptyError",
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionRefusedError",
        "ConnectionAbortedError",
        "BrokenPipeError",
        "TimeoutError",
        "timeout",
    }
)
# Words in a message (lower case) that name a communication failure even when the type
# is a plain RuntimeError (gloo's "Connection closed by peer", NCCL's watchdog).
_COMMUNICATION_WORDS = (
    "gloo",
    "nccl",
    "connection reset",
    "connection closed",
    "connection refused",
    "broken pipe",
    "timed out",
    "timeout",
    "processgroup",
    "process group",
    "c10d",
    "socket",
)
# "ValueError: ...", "torch.distributed.DistBackendError: ...", "SystemExit: 2".
_TYPE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)(?::|$)")
# A cause named in a verdict line is cut to this many characters (a message is the
# worker's to write, and can be anything).
_SHOWN = 200


@dataclass(frozen=True)
class LoopPolicy:
    """When to stop restarting (``--max-no-progress-attempts``, ``--stop-on``,
    ``--no-requeue-exit-code``)."""

    attempts: int = 3  # K consecutive attempts; 0: never stop for a repeated cause
    stop_on: tuple[str, ...] = ()  # exception types that stop at once before any step
    exit_code: int = 93


@dataclass(frozen=True)
class Cause:
    """A fault the program made by itself: the same one twice is the same ``Cause``."""

    rank: int | None
    exit: str  # "exit code 1", "signal SIGSEGV"
    error: str = ""  # "ValueError: config key 'lr' missing", or "" without an error file

    @property
    def error_type(self) -> str:
        m = _TYPE.match(self.error)
        return m.group(1) if m else ""

    def describe(self) -> str:
        rank = "?" if self.rank is None else self.rank
        what = self.error if self.error else self.exit
        if len(what) > _SHOWN:
            what = what[: _SHOWN - 3] + "..."
        return f"rank {rank} {what!r}" if self.error else f"rank {rank} {what}"


@dataclass(frozen=True)
class AttemptEnd:
    """A failed attempt as the policy sees it."""

    attempt: int
    cause: Cause | None  # None: not the program's own fault (see ``cause_of``)
    furthest_step: int | None = None  # the furthest step any local rank reported
    furthest_checkpoint: int | None = None  # the furthest step a checkpoint committed


@dataclass(frozen=True)
class Verdict:
    """Restarting cannot help: why, and with which exit code to stop."""

    cause: Cause
    attempts: tuple[int, ...]  # the attempts that ended the same way
    exit_code: int
    at_once: bool = False  # an error of ``--stop-on``

    def line(self) -> str:
        if self.at_once:
            why = f"{self.cause.describe()} before its first step, an error of --stop-on"
        else:
            why = (
                f"{self.cause.describe()} ended {len(self.attempts)} attempts in a row "
                f"({', '.join(map(str, self.attempts))}) with no progress"
            )
        return f"crash loop: {why}; not restarting (exit code {self.exit_code}: do not requeue)"


def _is_communication(error: str) -> bool:
    name = _TYPE.match(error)
    if name is not None and name.group(1).rsplit(".", 1)[-1] in _COMMUNICATION_TYPES:
        return True
    low = error.lower()
    return any(word in low for word in _COMMUNICATION_WORDS)


def cause_of(records: Sequence[FailureRecord]) -> Cause | None:
    """The program's own fault that ended a round, or None when the round ended for a
    reason a restart may not meet again: a node lost or excluded, a shutdown asked for,
    a hang (the supervisor's ``reason``), a signal from outside, a communication error.
    The root cause is the earliest worker failure of every node's reports."""
    if any(not isinstance(r, WorkerFailed) for r in records):
        return None
    workers = [r for r in records if isinstance(r, WorkerFailed)]
    if not workers:
        return None
    first = min(workers, key=lambda w: w.timestamp)
    if first.reason:
        return None
    if first.signal is not None:
        if first.signal not in _SELF_INFLICTED:
            return None
        exit_ = f"signal {first.signal}"
    elif first.exitcode == 0:
        return None
    else:
        exit_ = f"exit code {first.exitcode}"
    if first.message and _is_communication(first.message):
        return None
    return Cause(rank=first.rank, exit=exit_, error=first.message)


def _stops_at_once(error_type: str, stop_on: Sequence[str]) -> bool:
    """Whether *error_type* is one of *stop_on*: by name, or as a subclass of a built-in
    exception named there (``ImportError`` takes ``ModuleNotFoundError`` too)."""
    if not error_type:
        return False
    short = error_type.rsplit(".", 1)[-1]
    for name in stop_on:
        if name in (error_type, short):
            return True
        base = getattr(builtins, name, None)
        raised = getattr(builtins, short, None) if "." not in error_type else None
        if (
            isinstance(base, type)
            and issubclass(base, BaseException)
            and isinstance(raised, type)
            and issubclass(raised, base)
        ):
            return True
    return False


def _beyond(value: int | None, before: int | None) -> bool:
    return value is not None and (before is None or value > before)


def progressed(history: Sequence[AttemptEnd], index: int) -> bool:
    """Whether attempt ``history[index]`` got further (a step or a committed checkpoint)
    than every attempt before it."""
    end = history[index]
    steps = [h.furthest_step for h in history[:index] if h.furthest_step is not None]
    ckpts = [h.furthest_checkpoint for h in history[:index] if h.furthest_checkpoint is not None]
    return _beyond(end.furthest_step, max(steps, default=None)) or _beyond(
        end.furthest_checkpoint, max(ckpts, default=None)
    )


def verdict(history: Sequence[AttemptEnd], policy: LoopPolicy) -> Verdict | None:
    """Whether the job should stop rather than restart after the last attempt of
    *history* (the job's failed attempts, in order)."""
    if not history:
        return None
    last = history[-1]
    cause = last.cause
    if cause is None:
        return None
    before_any_step = last.furthest_step is None and last.furthest_checkpoint is None
    if before_any_step and _stops_at_once(cause.error_type, policy.stop_on):
        return Verdict(cause, (last.attempt,), policy.exit_code, at_once=True)
    if policy.attempts <= 0:
        return None
    streak: list[int] = []
    for index in range(len(history) - 1, -1, -1):
        end = history[index]
        if end.cause != cause or progressed(history, index):
            break
        streak.append(end.attempt)
        if len(streak) == policy.attempts:
            return Verdict(cause, tuple(reversed(streak)), policy.exit_code)
    return None
