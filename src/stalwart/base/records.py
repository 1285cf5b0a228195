"""Bounds on the records a run keeps, and the check every reader of them makes.

Anything a worker says about itself (an exception's message, a traceback, a hang's
stacks) ends up in the job's store and in ``events.jsonl``, and whatever is in
``events.jsonl`` may have been written by a worker, by an older stalwart, or by hand.
So text is cut to a documented size where it enters a record (``clip``, ``bounded``),
is shown on a terminal with its control characters made visible (``printable``), and
a record read back is used only once it fits the types and ranges its readers rely
on (``reporting.event_schema``).

The sizes (characters):

* ``MESSAGE_LIMIT`` (4,096): a failure's exception message and reason;
* ``TRACEBACK_LIMIT`` (16,384): a failure's traceback (its last lines are kept);
* ``FIELD_LIMIT`` (65,536): any other string in an event record (a hang's stacks);
* ``EVENT_LINE_LIMIT`` (1 MiB): a line of ``events.jsonl`` longer than this is skipped.
"""

from __future__ import annotations

import math
import re
from typing import Any

MESSAGE_LIMIT = 4096
TRACEBACK_LIMIT = 16384
FIELD_LIMIT = 65536
EVENT_LINE_LIMIT = 1 << 20
#: Nesting kept in an event record's fields; deeper values become their (clipped) text.
DEPTH_LIMIT = 8


def clip(text: str, limit: int) -> str:
    """*text* when it fits in *limit* characters, else its start and (mostly) its end
    around a note of how much was cut; never longer than *limit*.

    The end is kept rather than the start because the last lines of a traceback (the
    raise and the exception) are the ones that name the fault."""
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    while True:  # the note's length depends on the figure in it: settle both
        note = f"\n[... {cut} characters cut ...]\n"
        room = limit - len(note)
        if room < 2:
            return text[-limit:] if limit > 0 else ""
        if len(text) - room == cut:
            break
        cut = len(text) - room
    head = room // 4
    return text[:head] + note + text[len(text) - (room - head) :]


def bounded(value: Any, limit: int = FIELD_LIMIT, depth: int = 0) -> Any:
    """A copy of an event record's field that can be written and read back: strings
    clipped to *limit*, numbers that JSON cannot hold (NaN, infinities) as None, and
    nesting beyond ``DEPTH_LIMIT`` replaced by a note."""
    if isinstance(value, str):
        return clip(value, limit)
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if depth >= DEPTH_LIMIT:
        # Not str(value): its own repr of a deep structure can exhaust the stack.
        return f"[{type(value).__name__} nested more than {DEPTH_LIMIT} deep]"
    if isinstance(value, dict):
        return {clip(str(k), 256): bounded(v, limit, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [bounded(v, limit, depth + 1) for v in value]
    return clip(str(value), limit)


# C0 and C1 control characters (and DEL) except newline and tab: what a terminal acts on.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_NO_NEWLINE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str, *, newlines: bool = False) -> str:
    """*text* with every control character shown as an escape (``\\x1b``), so a message
    cannot move the cursor, recolour or retitle the terminal it is printed on.
    newlines: keep line breaks and tabs (a traceback); else they are escaped too."""
    pattern = _CONTROL if newlines else _CONTROL_NO_NEWLINE
    return pattern.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
