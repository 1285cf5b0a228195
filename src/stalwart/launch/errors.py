"""Error files and failure records.

``@record`` writes ``error.json`` in torchrun's format when the wrapped function raises,
so tools that read torchrun's files read ours.  ``ProcessFailure`` is what the launcher
knows about one dead worker; ``root_cause`` picks the earliest one for the summary.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from stalwart.base import envvars
from stalwart.base.files import replace_file
from stalwart.base.records import MESSAGE_LIMIT, TRACEBACK_LIMIT, clip, printable

if TYPE_CHECKING:
    from stalwart.rendezvous.api import WorkerFailed

logger = logging.getLogger(__name__)


P = ParamSpec("P")
R = TypeVar("R")


def error_payload(exc: BaseException) -> dict[str, Any]:
    """The JSON torchrun's ``ErrorHandler`` writes, plus a nanosecond timestamp of ours."""
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(
                    traceback.format_exception(type(exc), exc, exc.__traceback__)
                ),
                # torch parses this field with int(), so it stays whole seconds.
                "timestamp": str(int(time.time())),
                "timestamp_ns": str(time.time_ns()),
            },
        }
    }


def write_error_file(exc: BaseException, path: str | None = None) -> Path | None:
    """Writes ``error.json`` for *exc*; returns the path, or None when no file is configured.

    An existing file is kept: the first error recorded in a process is the root cause,
    and a later wrapper (our bootstrap around a user's ``@record``) must not overwrite it.
    """
    target = path if path is not None else os.environ.get(envvars.ERROR_FILE)
    if not target:
        return None
    p = Path(target)
    if p.exists() and p.stat().st_size > 0:
        return p
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        replace_file(p, json.dumps(error_payload(exc)).encode())
    except OSError as err:
        logger.warning("could not write error file %s: %s", p, err)
        return None
    return p


def record(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator for a worker's entrypoint: an uncaught exception is written to the error
    file named by ``TORCHELASTIC_ERROR_FILE`` and then re-raised unchanged."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                write_error_file(exc)
            raise
        except BaseException as exc:
            write_error_file(exc)
            raise

    return wrapper


def signal_name(exitcode: int | None) -> str | None:
    """``SIGKILL`` for an exit code of ``-9`` (how Popen reports a signal), else None."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


@dataclass
class ProcessFailure:
    """One failed worker: what it was, how it ended, and what it said."""

    local_rank: int
    pid: int
    exitcode: int
    error_file: str = ""
    rank: int | None = None
    node_rank: int = 0
    timestamp: float = field(default_factory=time.time)
    message: str = ""
    traceback: str = ""
    reason: str = ""  # set by the supervisor, e.g. "hang: heartbeat timeout 2.0 s"

    def __post_init__(self) -> None:
        self._read_error_file()

    def _read_error_file(self) -> None:
        if not self.error_file or not os.path.isfile(self.error_file):
            return
        try:
            data = json.loads(Path(self.error_file).read_text())
        except (OSError, ValueError) as err:
            logger.warning("unreadable error file %s: %s", self.error_file, err)
            return
        msg = data.get("message") if isinstance(data, dict) else None
        # A worker's words are cut to the documented sizes as they enter the launcher.
        if isinstance(msg, dict):
            self.message = clip(str(msg.get("message", "")), MESSAGE_LIMIT)
            extra = msg.get("extraInfo")
            extra = extra if isinstance(extra, dict) else {}
            self.traceback = clip(str(extra.get("py_callstack", "")), TRACEBACK_LIMIT)
            ts_ns = extra.get("timestamp_ns")
            ts = extra.get("timestamp")
            try:
                if ts_ns is not None:
                    self.timestamp = int(ts_ns) / 1e9
                elif ts is not None:
                    self.timestamp = float(int(ts))
            except (ValueError, TypeError, OverflowError):
                pass
        elif isinstance(msg, str):
            self.message = clip(msg, MESSAGE_LIMIT)

    @property
    def signal(self) -> str | None:
        return signal_name(self.exitcode)

    def describe_exit(self) -> str:
        sig = self.signal
        return f"signal {sig}" if sig else f"exit code {self.exitcode}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "local_rank": self.local_rank,
            "rank": self.rank,
            "node_rank": self.node_rank,
            "pid": self.pid,
            "exitcode": self.exitcode,
            "signal": self.signal,
            "timestamp": self.timestamp,
            "message": clip(self.message, MESSAGE_LIMIT),
            "traceback": clip(self.traceback, TRACEBACK_LIMIT),
            "error_file": self.error_file,
            "reason": clip(self.reason, MESSAGE_LIMIT),
        }

    def to_record(self) -> WorkerFailed:
        # Imported here: workers import this module (``record``) and need no rendezvous.
        from stalwart.rendezvous.api import WorkerFailed

        return WorkerFailed(
            local_rank=self.local_rank,
            rank=self.rank,
            node_rank=self.node_rank,
            pid=self.pid,
            exitcode=self.exitcode,
            signal=self.signal,
            timestamp=self.timestamp,
            message=self.message,
            traceback=self.traceback,
            error_file=self.error_file,
            reason=self.reason,
        )

    @classmethod
    def from_record(cls, rec: WorkerFailed) -> ProcessFailure:
        """A failure another node reported (validated when read from the store)."""
        f = cls(
            local_rank=rec.local_rank,
            pid=rec.pid,
            exitcode=rec.exitcode,
            rank=rec.rank,
            node_rank=rec.node_rank,
        )
        f.timestamp = rec.timestamp or f.timestamp
        f.message = rec.message
        f.traceback = rec.traceback
        f.error_file = rec.error_file
        f.reason = rec.reason
        return f

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProcessFailure:
        f = cls(
            local_rank=int(data["local_rank"]),
            pid=int(data["pid"]),
            exitcode=int(data["exitcode"]),
            rank=data.get("rank"),
            node_rank=int(data.get("node_rank", 0)),
        )
        f.timestamp = float(data.get("timestamp", f.timestamp))
        f.message = str(data.get("message", ""))
        f.traceback = str(data.get("traceback", ""))
        f.error_file = str(data.get("error_file", ""))
        f.reason = str(data.get("reason", ""))
        return f


def root_cause(failures: list[ProcessFailure]) -> ProcessFailure:
    """The earliest failure: the others are usually peers reacting to it."""
    if not failures:
        raise ValueError("root_cause() needs at least one failure")
    return min(failures, key=lambda f: f.timestamp)


def traceback_head(text: str, lines: int = 12) -> str:
    """The last *lines* of a traceback: the frames nearest the raise and the message."""
    parts = text.rstrip().splitlines()
    return "\n".join(parts[-lines:])


def format_summary(
    failures: list[ProcessFailure], *, run_id: str, attempts: int, log_dir: str | None
) -> str:
    """A plain-text report a tired engineer can act on at 3 a.m."""
    cause = root_cause(failures)
    rank = cause.rank if cause.rank is not None else "?"
    lines = [
        "=" * 72,
        f"stalwart: job {run_id} FAILED after {attempts} attempt(s)",
        f"root cause: rank {rank} (node {cause.node_rank}, local rank {cause.local_rank}, "
        f"pid {cause.pid}) {cause.describe_exit()}",
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
                f"{f.describe_exit()} at +{f.timestamp - cause.timestamp:.3f}s"
                + (f": {printable(f.message)}" if f.message else "")
                + (f" [{printable(f.reason)}]" if f.reason else "")
            )
    if log_dir:
        lines.append(f"run folder: {log_dir}")
    lines.append("=" * 72)
    return "\n".join(lines)
