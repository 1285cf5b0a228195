"""Reading a run's ``events.jsonl`` back: a stream of checked records
(``event_schema``), from an offset, and where a reused file's last run begins."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stalwart.base.events import Event
from stalwart.base.records import EVENT_LINE_LIMIT, printable
from stalwart.reporting.event_schema import BadRecord, parse_event_line

logger = logging.getLogger(__name__)

# Files already warned about in this process: a reader that goes over a file several
# times (``stalwart report``) says once that it skipped lines.
_warned: set[str] = set()


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
