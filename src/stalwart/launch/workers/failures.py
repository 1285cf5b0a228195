"""The launcher's one failure record, read at the edge, and what it says about a job.

A dead worker becomes a ``WorkerFailed`` (the record nodes exchange through the store,
``rendezvous.api``) in one place: ``read_failure``, which reads the worker's error file
(torchrun's format, written by ``errors.record`` or torch's own ``@record``).  The file is
the worker's to write, so it is read bounded and every field is checked; a record is
frozen from then on, and a later fact (the node's rank, a hang that explains the death)
makes a new one.  ``root_cause`` and ``format_summary`` read records only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stalwart.base.records import MESSAGE_LIMIT, TRACEBACK_LIMIT, clip, printable
from stalwart.launch.workers.errors import (
    BadErrorFile,
    load_error_file,
    signal_name,
)
from stalwart.rendezvous.api import WorkerFailed

logger = logging.getLogger(__name__)


def _error_file(path: str) -> tuple[str, str, float | None]:
    """(message, traceback, timestamp) from a torchrun error file; empty when there is
    none, and for what does not parse (logged)."""
    if not path:
        return "", "", None
    try:
        data = load_error_file(path)
    except BadErrorFile as err:
        logger.warning("%s", err)
        return "", "", None
    msg = data.get("message") if isinstance(data, dict) else None
    # A worker's words are cut to the documented sizes as they enter the launcher.
    if isinstance(msg, str):
        return clip(msg, MESSAGE_LIMIT), "", None
    if not isinstance(msg, dict):
        return "", "", None
    extra = msg.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    stamp: float | None = None
    for key, per_second in (("timestamp_ns", 1e9), ("timestamp", 1.0)):
        value = extra.get(key)
        if isinstance(value, str | int) and not isinstance(value, bool):
            try:
                stamp = int(value) / per_second
                break
            except (ValueError, OverflowError):
                continue
    message = clip(str(msg.get("message", "")), MESSAGE_LIMIT)
    return message, clip(str(extra.get("py_callstack", "")), TRACEBACK_LIMIT), stamp


def read_failure(
    local_rank: int,
    pid: int,
    exitcode: int,
    *,
    exited_at: float,
    rank: int | None = None,
    node_rank: int = 0,
    error_file: str = "",
) -> WorkerFailed:
    """The record of a worker that exited with *exitcode* at *exited_at* (wall clock).

    A written error file is the moment of the exception, which comes before the exit;
    a time in it after the exit (a clock that stepped, a forged file) is not believed."""
    message, traceback, stamp = _error_file(error_file)
    when = exited_at if stamp is None or not message else min(stamp, exited_at)
    return WorkerFailed(
        local_rank=local_rank,
        rank=rank,
        node_rank=node_rank,
        pid=pid,
        exitcode=exitcode,
        signal=signal_name(exitcode),
        timestamp=when,
        message=message,
        traceback=traceback,
        error_file=error_file,
    )


def describe_exit(failure: WorkerFailed) -> str:
    return f"signal {failure.signal}" if failure.signal else f"exit code {failure.exitcode}"


def failure_fields(failure: WorkerFailed) -> dict[str, Any]:
    """The record as an event's ``root_cause`` (the keys the reports read)."""
    return {
        "local_rank": failure.local_rank,
        "rank": failure.rank,
        "node_rank": failure.node_rank,
        "pid": failure.pid,
        "exitcode": failure.exitcode,
        "signal": failure.signal,
        "timestamp": failure.timestamp,
        "message": clip(failure.message, MESSAGE_LIMIT),
        "traceback": clip(failure.traceback, TRACEBACK_LIMIT),
        "error_file": failure.error_file,
        "reason": clip(failure.reason, MESSAGE_LIMIT),
    }


def root_cause(failures: Sequence[WorkerFailed]) -> WorkerFailed:
    """The earliest failure: the others are usually peers reacting to it."""
    if not failures:
        raise ValueError("root_cause() needs at least one failure")
    return min(failures, key=lambda f: f.timestamp)


def traceback_head(text: str, lines: int = 12) -> str:
    """The last *lines* of a traceback: the frames nearest the raise and the message."""
    parts = text.rstrip().splitlines()
    return "\n".join(parts[-lines:])


def format_summary(
    failures: Sequence[WorkerFailed], *, run_id: str, attempts: int, log_dir: str | None
) -> str:
    """A plain-text report a tired engineer can act on at 3 a.m."""
    cause = root_cause(failures)
    rank = cause.rank if cause.rank is not None else "?"
    lines = [
        "=" * 72,
        f"stalwart: job {run_id} FAILED after {attempts} attempt(s)",
        f"root cause: rank {rank} (node {cause.node_rank}, local rank {cause.local_rank}, "
        f"pid {cause.pid}) {describe_exit(cause)}",
    ]
    # A worker's words reach the terminal with their control characters made visible.
    if cause.reason:
        lines.append(f"reason: {printable(cause.reason)}")
    if cause.message:
        lines.append(f"exception: {printable(cause.message)}")
    if cause.traceback:
        lines.append("traceback (last lines):")
        lines.extend("  " + printable(ln) for ln in traceback_head(cause.traceback).splitlines())
    if cause.error_file:
        folder = Path(cause.error_file).parent
        # Only files the worker really left: without -r/-t there are no logs.
        if Path(cause.error_file).is_file():
            lines.append(f"error file: {cause.error_file}")
        logs = [str(p) for p in (folder / "stdout.log", folder / "stderr.log") if p.is_file()]
        if logs:
            lines.append(f"logs: {'  '.join(logs)}")
    others = [f for f in failures if f is not cause]
    if others:
        lines.append("other failures:")
        for f in sorted(others, key=lambda x: x.timestamp):
            lines.append(
                f"  rank {f.rank} (node {f.node_rank}, local rank {f.local_rank}, pid {f.pid}) "
                f"{describe_exit(f)} at +{f.timestamp - cause.timestamp:.3f}s"
                + (f": {printable(f.message)}" if f.message else "")
                + (f" [{printable(f.reason)}]" if f.reason else "")
            )
    if log_dir:
        lines.append(f"run folder: {log_dir}")
    lines.append("=" * 72)
    return "\n".join(lines)
