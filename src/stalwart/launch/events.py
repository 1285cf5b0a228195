"""The run's event log: one JSON object per line in ``<log_dir>/<run_id>/events.jsonl``.

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stalwart.base.events import Event
from stalwart.launch.runfiles import open_append


class EventLog:
    """Appends structured events to a JSONL file; every line carries host and node rank."""

    def __init__(self, path: Path | None, *, run_id: str, node_rank: int | None = None) -> None:
        self.path = path
        self._base: dict[str, Any] = {"run_id": run_id, "host": socket.gethostname()}
        if node_rank is not None:
            self._base["node_rank"] = node_rank
        self._lock = threading.Lock()
        self._fd: int | None = None
        if path is not None:
            # O_APPEND keeps each line whole even if several launchers share the file;
            # a link planted at the path is refused (the folder is ``make_run_dir``'s).
            self._fd = open_append(path)

    def set_node_rank(self, node_rank: int) -> None:
        self._base["node_rank"] = node_rank

    def emit(self, event: Event, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {
            "event": event,
            "time": time.time(),
            "mono": time.monotonic(),
            "pid": os.getpid(),
            **self._base,
            **fields,
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


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Yields the events of a file in order, skipping a torn last line."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                yield obj


# A line longer than this is not one of ours (the longest, a hang dossier's summary, is a
# few KiB): it is skipped, not held in memory.
_MAX_LINE = 1 << 20


class EventTail:
    """Reads the events appended to a file since the last read, a whole line at a time:
    a torn last line waits for the next read, an over-long or malformed one is skipped."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._offset = 0
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
