"""The run's event log: one JSON object per line in ``<log_dir>/<run_id>/events.jsonl``.

Every state change of a launcher is appended here with a wall-clock and a monotonic
timestamp.  It is the single record that ``stalwart report``, the benchmarks and the
tests read, so it is append-only, flushed per line, and safe to write from threads.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stalwart.base.events import Event
from stalwart.base.records import EVENT_LINE_LIMIT, bounded, printable
from stalwart.launch.event_schema import BadRecord, parse_event_line
from stalwart.launch.runfiles import open_append

logger = logging.getLogger(__name__)

# Files already warned about in this process: a reader that goes over a file several
# times (``stalwart report``) says once that it skipped lines.
_warned: set[str] = set()


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


def read_events(path: Path, *, start: int = 0) -> Iterator[dict[str, Any]]:
    """Yields the event records of a file in order, from byte *start* on, one line in
    memory at a time. A line that is not a usable record (``records.parse_event_line``)
    is skipped; the skipped lines are reported in one warning when the reading ends
    (once per file and process).
    A torn last line (still being written) is skipped silently."""
    skipped = 0
    first = ""
    number = 0
    try:
        with open(path, "rb") as fh:
            if start:
                fh.seek(start)
            while True:
                line = fh.readline(EVENT_LINE_LIMIT + 1)
                if not line:
                    break
                number += 1
                whole = line.endswith(b"\n")
                if not whole and len(line) > EVENT_LINE_LIMIT:
                    size = len(line)
                    while line and not line.endswith(b"\n"):  # the rest of a long line
                        line = fh.readline(EVENT_LINE_LIMIT)
                        size += len(line)
                    skipped += 1
                    first = first or f"line {number}: a line of {size} bytes or more"
                    continue
                if not line.strip():
                    continue
                try:
                    record = parse_event_line(line)
                except BadRecord as err:
                    if whole:
                        skipped += 1
                        first = first or f"line {number}: {err}"
                    continue
                yield record
    finally:
        if skipped and str(path) not in _warned:
            _warned.add(str(path))
            logger.warning(
                "%s: skipped %d malformed event line(s) (first: %s)",
                path,
                skipped,
                printable(first),
            )


def last_run_start(path: Path) -> int:
    """The byte offset where the file's last run begins. A run folder reused with the
    same run id holds earlier runs first; a run begins at a ``launcher_start`` that
    follows a ``launcher_exit`` (several launchers of one job start before any exits).
    Read line by line: the file can be large."""
    start = offset = 0
    exited = False
    with open(path, "rb") as fh:
        while line := fh.readline(EVENT_LINE_LIMIT + 1):
            here = offset
            offset += len(line)
            # Cheap first: most lines are neither kind.
            if b"launcher_" not in line:
                continue
            try:
                kind = parse_event_line(line)["event"]
            except BadRecord:
                continue
            if kind == Event.LAUNCHER_EXIT:
                exited = True
            elif kind == Event.LAUNCHER_START and exited:
                start, exited = here, False
    return start
