"""torch's ``TailLog`` over stalwart's ``Tee``: copy the lines of several log files to
one destination, each line prefixed with its file's header, from ``start()`` until
``stop()``.

What the ``Tee`` adds to torch's behaviour: a file does not have to exist yet, but a
path that is a link, a FIFO or a folder is refused (one log line) instead of followed
or blocked on; a line without end is copied in 64 KiB pieces; a destination more than
16 MiB behind a file is told how many lines it missed instead of growing the tailer's
memory; and ``stop()`` copies a last line without newline before returning.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO

from stalwart.launch.files.logs import Tee
from stalwart.launch.files.redirects import open_regular

logger = logging.getLogger(__name__)

# A destination named by path is appended to; a link or FIFO there is refused (see
# redirects.py for why the open must not wait).
_DST_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_destination(path: str | os.PathLike[str]) -> IO[str]:
    fd = open_regular(path, _DST_FLAGS, "TailLog destination")
    return os.fdopen(fd, "a", encoding="utf-8", errors="replace")


class TailLog:
    """Tails ``log_files`` (local rank -> path) into ``dst`` (a text stream, or a path
    that is appended to) with the header ``[{name}{local_rank}]:`` unless
    ``log_line_prefixes`` names one; only the lines ``log_line_filter`` accepts are
    copied (it sees each line with its newline)."""

    def __init__(
        self,
        name: str,
        log_files: Mapping[int, str | os.PathLike[str]],
        dst: IO[str] | str | os.PathLike[str] | None,
        log_line_prefixes: Mapping[int, str] | None = None,
        interval_sec: float = 0.1,
        log_line_filter: Callable[[str], bool] | None = None,
    ) -> None:
        if not (isinstance(interval_sec, int | float) and math.isfinite(interval_sec)) or (
            interval_sec < 0
        ):
            raise ValueError(f"TailLog interval_sec={interval_sec!r}: expected a number >= 0")
        self._name = name
        self._log_files = {int(lr): Path(p) for lr, p in log_files.items()}
        self._dst = dst
        self._prefixes = dict(log_line_prefixes or {})
        self._filter = log_line_filter
        self._tee = Tee(interval=interval_sec)
        # One thread runs the tee for all files; the executor hands its failure back to
        # stop() instead of losing it in a bare thread.
        self._threadpool: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"TailLog_{name}")
            if self._log_files
            else None
        )
        self._run: Future[None] | None = None
        self._owned_dst: IO[str] | None = None
        self._stopped = False

    def start(self) -> TailLog:
        if self._threadpool is None or self._dst is None or self._run is not None:
            return self
        if isinstance(self._dst, str | os.PathLike):
            self._owned_dst = _open_destination(self._dst)
            sink: IO[str] = self._owned_dst
        else:
            sink = self._dst
        for lr, path in self._log_files.items():
            prefix = self._prefixes.get(lr, f"[{self._name}{lr}]:")
            self._tee.add(path, sink, prefix, self._filter)
        self._run = self._threadpool.submit(self._tee.run)
        return self

    def stop(self) -> None:
        """Copies what is left in the files, then ends the thread; idempotent."""
        if self._stopped:
            return
        try:
            self._tee.stop()
            if self._run is not None:
                try:
                    self._run.result()
                except Exception as e:
                    logger.error("error in the log tailer %s: %s", self._name, e, exc_info=True)
            if self._threadpool is not None:
                self._threadpool.shutdown(wait=True)
        finally:
            if self._owned_dst is not None:
                with contextlib.suppress(OSError):
                    self._owned_dst.close()
            self._stopped = True

    def stopped(self) -> bool:
        return self._stopped


__all__ = ["TailLog", "logger"]
