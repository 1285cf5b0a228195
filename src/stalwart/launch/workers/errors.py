"""Error files, the worker's side.

``@record`` writes ``error.json`` in torchrun's format when the wrapped function raises,
so tools that read torchrun's files read ours.  Workers import this module: it needs
nothing of the launcher.  The launcher reads the file back in ``launch.failures``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import stat
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from stalwart.base import envvars
from stalwart.base.files import replace_file

logger = logging.getLogger(__name__)


# An error file is a message and a traceback; a program's exception can carry megabytes
# of text (torch's own ``@record`` writes it whole), so a file is read up to this and
# anything bigger is not believed.
MAX_ERROR_FILE = 32 << 20


class BadErrorFile(ValueError):
    """An error file that exists but cannot be believed (not a regular file, too big,
    not JSON)."""


def load_error_file(path: str) -> Any:
    """The parsed JSON of the error file at *path*, read bounded and without following a
    link; None when there is no such file. Raises BadErrorFile for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise BadErrorFile(f"error file {path}: cannot open: {err.strerror}") from None
    try:
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):  # a pipe planted there
                raise BadErrorFile(f"error file {path}: not a regular file")
            raw = fh.read(MAX_ERROR_FILE + 1)
    except OSError as err:
        raise BadErrorFile(f"error file {path}: unreadable: {err.strerror}") from None
    if len(raw) > MAX_ERROR_FILE:
        raise BadErrorFile(
            f"error file {path}: over {MAX_ERROR_FILE} bytes, expected a JSON record"
        )
    try:
        return json.loads(raw)
    except ValueError as err:  # UnicodeDecodeError included
        raise BadErrorFile(f"error file {path}: not JSON ({err})") from None
    except RecursionError:
        raise BadErrorFile(f"error file {path}: JSON nested too deeply") from None


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
