"""The run's event log: one JSON object per line in ``<log_dir>/<run_id>/events.jsonl``
(its readers are ``stalwart.reporting.read``).

Every state change of a launcher is appended here with a wall-clock and a monotonic
timestamp.  It is the single record that ``stalwart report``, the benchmarks and the
tests read, so it is append-only, flushed per line, and safe to write from threads.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from stalwart.base.events import Event
from stalwart.base.records import bounded
from stalwart.launch.files.runfiles import open_append


class EventLog:
    """Appends structured events to a JSONL file; every line carries host and node rank."""

    def __init__(self, path: Path | None, *, run_id: str, node_rank: int | None = None) -> None:
        self.path = path
        self._base: dict[str, Any] = {"run_id": run_id, "host": socket.gethostname()}
        if node_rank is not None:
            self._base["node_rank"] = node_rank
        self._lock = threading.Lock()
        self._fd: int | None = None
        #: Where this launcher's run starts in the file: a reused run folder (same run
        #: id) holds earlier runs before it, which this run's accounting leaves out.
        self.start_offset = 0
        if path is not None:
            # O_APPEND keeps each line whole even if several launchers share the file;
            # a link planted at the path is refused (the folder is ``make_run_dir``'s).
            self._fd = open_append(path)
            self.start_offset = os.fstat(self._fd).st_size

    def set_node_rank(self, node_rank: int) -> None:
        self._base["node_rank"] = node_rank

    def emit(self, event: Event, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {
            "event": event,
            "time": time.time(),
            "mono": time.monotonic(),
            "pid": os.getpid(),
            **self._base,
            # What a worker said (a message, a traceback, stacks) is cut to size here.
            **{k: bounded(v) for k, v in fields.items()},
        }
        if self._fd is not None:
            line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
            with self._lock:
                os.write(self._fd, line)
        return record

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


# A line longer than this is not one of ours (the longest, a hang dossier's summary, is a
# few KiB): it is skipped, not held in memory.
_MAX_LINE = 1 << 20


class EventTail:
    """Reads the events appended to a file since the last read, a whole line at a time:
    a torn last line waits for the next read, an over-long or malformed one is skipped."""

    def __init__(self, path: Path | None, start: int = 0) -> None:
        self.path = path
        self._offset = start
        self._partial = b""
        self._skipping = False  # inside an over-long line, until its newline

    def read(self) -> list[dict[str, Any]]:
        if self.path is None:
            return []
        out: list[dict[str, Any]] = []
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                while chunk := fh.read(_MAX_LINE):
                    self._offset += len(chunk)
                    out.extend(self._lines(chunk))
        except OSError:
            return out
        return out

    def _lines(self, chunk: bytes) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        *whole, rest = (self._partial + chunk).split(b"\n")
        self._partial = b""
        for line in whole:
            if self._skipping:
                self._skipping = False
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
        if len(rest) > _MAX_LINE:
            self._skipping = True
        elif not self._skipping:
            self._partial = rest
        return out
