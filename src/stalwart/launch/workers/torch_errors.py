"""torch elastic's error-file API (``ErrorHandler``, ``get_error_handler``,
``ProcessFailure``, ``ChildFailedError``, ``record``) over stalwart's error files.

For code written against ``torch.distributed.elastic.multiprocessing.errors``; stalwart's
own ``errors.record`` keeps its behaviour (the first error recorded in a process is
kept). What differs from torch, deliberately: an error file is read bounded
(``errors.MAX_ERROR_FILE``), without following a link, and only when it is a regular
file; one that cannot be believed raises ``BadErrorFile`` naming the file and what was
expected; a worker's message is cut to ``records.MESSAGE_LIMIT`` characters.
Workers import this module: it needs nothing of the launcher.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import functools
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, overload

from stalwart.base import envvars
from stalwart.base.files import replace_file
from stalwart.base.records import MESSAGE_LIMIT, clip
from stalwart.launch.workers.errors import (
    BadErrorFile,
    error_payload,
    load_error_file,
    signal_name,
)

logger = logging.getLogger(__name__)

__all__ = [
    "BadErrorFile",
    "ChildFailedError",
    "ErrorHandler",
    "ProcessFailure",
    "get_error_handler",
    "record",
]

NOT_AVAILABLE = "<N/A>"
NO_MESSAGE = "<NONE>"
# torch's wording for a failure without an error file (tools match on it).
HOW_TO_GET_TRACEBACKS = (
    "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
)

P = ParamSpec("P")
R = TypeVar("R")


class ErrorHandler:
    """Writes this process's error file (TORCHELASTIC_ERROR_FILE) and copies a child's."""

    def _get_error_file_path(self) -> str | None:
        return os.environ.get(envvars.ERROR_FILE) or None

    def initialize(self) -> None:
        """Tracebacks of every thread on a fatal signal (best effort)."""
        try:
            faulthandler.enable(all_threads=True)
        except Exception as exc:
            logger.warning("could not enable faulthandler: %s", exc)

    def _write(self, path: str, data: Any) -> None:
        try:
            replace_file(Path(path), json.dumps(data).encode())
        except OSError as exc:
            logger.warning("could not write error file %s: %s", path, exc)

    def record_exception(self, e: BaseException) -> None:
        """Writes *e* to the error file (replacing one there); without a file configured,
        only logs that none is."""
        path = self._get_error_file_path()
        if path is None:
            logger.info("no %s set: %r not written to an error file", envvars.ERROR_FILE, e)
            return
        self._write(path, error_payload(e))

    def override_error_code_in_rootcause_data(
        self, rootcause_error_file: str, rootcause_error: dict[str, Any], error_code: int = 0
    ) -> None:
        message = rootcause_error.get("message")
        if not isinstance(message, dict):
            logger.warning(
                "error file %s has no message record; errorCode %d not added",
                rootcause_error_file,
                error_code,
            )
            return
        message["errorCode"] = error_code

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copies a child's error file (the root cause) to this process's, with
        *error_code* added when not 0; without a file of our own, logs it."""
        data = load_error_file(rootcause_error_file)
        if not isinstance(data, dict):
            raise BadErrorFile(
                f"error file {rootcause_error_file}: "
                + ("missing" if data is None else "expected a JSON object")
            )
        if error_code:
            self.override_error_code_in_rootcause_data(rootcause_error_file, data, error_code)
        path = self._get_error_file_path()
        if path is None:
            logger.error("child error file (%s):\n%s", rootcause_error_file, json.dumps(data))
            return
        self._write(path, data)


def get_error_handler() -> ErrorHandler:
    return ErrorHandler()


def _parse(path: str, data: Any) -> tuple[str, int]:
    """(message, timestamp) of an error file in either of torch's two layouts."""
    if not isinstance(data, dict) or "message" not in data:
        raise BadErrorFile(f"error file {path}: expected a JSON object with a 'message'")
    message = data["message"]
    if isinstance(message, str):
        stamp = data.get("timestamp")
    elif isinstance(message, dict):
        extra = message.get("extraInfo")
        stamp = extra.get("timestamp") if isinstance(extra, dict) else None
        message = message.get("message")
    else:
        raise BadErrorFile(f"error file {path}: 'message' must be a string or an object")
    if isinstance(stamp, bool) or not isinstance(stamp, int | str):
        raise BadErrorFile(f"error file {path}: expected an integer timestamp, got {stamp!r}")
    try:
        when = int(stamp)
    except ValueError:
        raise BadErrorFile(f"error file {path}: timestamp {stamp!r} is not an integer") from None
    return clip(str(message if message is not None else ""), MESSAGE_LIMIT), when


@dataclasses.dataclass
class ProcessFailure:
    """A failed child process, with what its error file (if any) says."""

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    error_file_data: dict[str, Any] = dataclasses.field(init=False)
    message: str = dataclasses.field(init=False)
    timestamp: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        data = load_error_file(self.error_file) if self.error_file else None
        if data is None:
            self.error_file = NOT_AVAILABLE
            self.error_file_data = {"message": NO_MESSAGE}
            self.message = ""
            self.timestamp = int(time.time())
        else:
            self.message, self.timestamp = _parse(self.error_file, data)
            self.error_file_data = data
        if not self.message:
            # A signal leaves no error file; say which one it was.
            if self.exitcode < 0:
                self.message = (
                    f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
                )
            else:
                self.message = HOW_TO_GET_TRACEBACKS

    def signal_name(self) -> str:
        return signal_name(self.exitcode) or NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        return datetime.datetime.fromtimestamp(self.timestamp).isoformat(sep="_")


class ChildFailedError(Exception):
    """Raised by a launcher when some of its children failed; the one that failed first
    is the root cause."""

    def __init__(self, name: str, failures: dict[int, ProcessFailure]) -> None:
        if not failures:
            raise ValueError(f"ChildFailedError({name!r}): expected at least one failure")
        self.name = name
        self.failures = failures
        super().__init__(self.format_msg())

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        rank = min(self.failures, key=lambda r: self.failures[r].timestamp)
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        root_rank, root = self.get_first_failure()
        width = 60
        lines = [boarder_delim * width, f"{self.name} FAILED", section_delim * width]
        lines.append("Root Cause (first observed failure):")
        lines += self._format_failure(root_rank, root)
        others = [(r, f) for r, f in self.failures.items() if r != root_rank]
        lines.append(section_delim * width)
        lines.append("Failures:" if others else "Failures: <NO_OTHER_FAILURES>")
        for rank, failure in others:
            lines += self._format_failure(rank, failure)
        lines.append(boarder_delim * width)
        return "\n".join(lines)

    @staticmethod
    def _format_failure(rank: int, failure: ProcessFailure) -> list[str]:
        exit_text = str(failure.exitcode)
        if failure.exitcode < 0:
            exit_text += f" ({failure.signal_name()})"
        return [
            f"[{rank}]:",
            f"  time      : {failure.timestamp_isoformat()}",
            f"  host      : {socket.getfqdn()}",
            f"  rank      : {rank} (local_rank: {failure.local_rank})",
            f"  exitcode  : {exit_text} (pid: {failure.pid})",
            f"  error_file: {failure.error_file}",
            "  traceback : " + failure.message.replace("\n", "\n    "),
        ]


@overload
def record(
    fn: Callable[P, R], error_handler: ErrorHandler | None = None
) -> Callable[P, R | None]: ...
@overload
def record(
    fn: None = None, error_handler: ErrorHandler | None = None
) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...
def record(
    fn: Callable[P, R] | None = None, error_handler: ErrorHandler | None = None
) -> Callable[P, R | None] | Callable[[Callable[P, R]], Callable[P, R | None]]:
    """torch's ``@record``: an exception is written to the error file and re-raised; a
    ``ChildFailedError`` copies the first failed child's error file instead; a
    ``SystemExit`` with code 0 returns None, as under torch."""

    def wrap(f: Callable[P, R]) -> Callable[P, R | None]:
        @functools.wraps(f)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            handler = error_handler or get_error_handler()
            handler.initialize()
            try:
                return f(*args, **kwargs)
            except SystemExit as exc:
                if exc.code == 0:
                    return None
                raise
            except ChildFailedError as exc:
                rank, failure = exc.get_first_failure()
                if failure.error_file != NOT_AVAILABLE:
                    handler.dump_error_file(failure.error_file, failure.exitcode)
                else:
                    logger.info(
                        "local rank %d (pid %d) failed without an error file; "
                        "decorate its entrypoint with @record to get one",
                        rank,
                        failure.pid,
                    )
                raise
            except Exception as exc:
                handler.record_exception(exc)
                raise

        return wrapper

    if fn is None:
        return wrap
    return wrap(fn)
