"""Bounds on the records a run keeps, and the check every reader of them makes.

Anything a worker says about itself (an exception's message, a traceback, a hang's
stacks) ends up in the job's store and in ``events.jsonl``, and whatever is in
``events.jsonl`` may have been written by a worker, by an older stalwart, or by hand.
So text is cut to a documented size where it enters a record (``clip``, ``bounded``),
and a record is used only once it fits the types and ranges its readers rely on
(``parse_event_line``); one that does not is skipped, and the reader warns once.

The sizes (characters):

* ``MESSAGE_LIMIT`` (4,096): a failure's exception message and reason;
* ``TRACEBACK_LIMIT`` (16,384): a failure's traceback (its last lines are kept);
* ``FIELD_LIMIT`` (65,536): any other string in an event record (a hang's stacks);
* ``EVENT_LINE_LIMIT`` (1 MiB): a line of ``events.jsonl`` longer than this is skipped.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

import msgspec

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
    note = f"\n[... {len(text) - limit} characters cut ...]\n"
    if limit <= len(note) + 2:
        return text[-limit:] if limit > 0 else ""
    room = limit - len(note)
    # The note's own length depends on how much is cut: recount with the real figure.
    note = f"\n[... {len(text) - room} characters cut ...]\n"
    room = max(limit - len(note), 0)
    head = room // 4
    return text[:head] + note + text[len(text) - (room - head) :]


def bounded(value: Any, limit: int = FIELD_LIMIT, depth: int = 0) -> Any:
    """A copy of an event record's field that can be written and read back: strings
    clipped to *limit*, numbers that JSON cannot hold (NaN, infinities) as None, and
    nesting beyond ``DEPTH_LIMIT`` flattened to text."""
    if isinstance(value, str):
        return clip(value, limit)
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if depth >= DEPTH_LIMIT:
        return clip(str(value), limit)
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


# -- reading events back -------------------------------------------------------------

# Seconds since the epoch up to the year 5138: anything else is not a time of this run.
Time = Annotated[float, msgspec.Meta(ge=0, le=1e11)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e9)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=2**31)]
Attempt = Annotated[int, msgspec.Meta(ge=-1, le=2**31)]
Step = Annotated[int, msgspec.Meta(ge=-(2**53), le=2**53)]
Code = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31)]


class RootCause(msgspec.Struct, kw_only=True):
    """The fields of a failure record the readers use (others pass unchecked)."""

    rank: Rank | None = None
    signal: str | None = None
    exitcode: Code | None = None
    reason: str | None = None
    message: str | None = None
    timestamp: Time | None = None


class EventFields(msgspec.Struct, kw_only=True):
    """The fields of an event record that ``report``, goodput, the timeline and the
    metrics read, with the types and ranges they assume; a record whose fields do not
    fit is not used. Fields not named here are kept as they are and never relied on."""

    event: str
    time: Time
    source: str | None = None
    run_id: str | None = None
    attempt: Attempt | None = None
    rank: Rank | None = None
    local_rank: Rank | None = None
    global_rank: Rank | None = None
    world_size: Rank | None = None
    step: Step | None = None
    step_time: Time | None = None
    exited_at: Time | None = None
    exitcode: Code | None = None
    exit_code: Code | None = None
    signal: str | None = None
    kind: str | None = None
    stacks: str | None = None
    fault: str | None = None
    last_heartbeat_age: Seconds | None = None
    save_s: Seconds | None = None
    stall_s: Seconds | None = None
    root_cause: RootCause | None = None


# Kinds whose readers index a field without a default: the field must be there.
_REQUIRED = {
    "worker_spawn": ("rank",),
    "hang_detected": ("global_rank",),
    "progress": ("step",),
}


class BadRecord(ValueError):
    """A line of ``events.jsonl`` that is not an event record the readers can use."""


def parse_event_line(raw: bytes) -> dict[str, Any]:
    """One event record from one line of ``events.jsonl``; ``BadRecord`` (a one-line
    reason) when the line is too long, not JSON, or its fields do not fit."""
    if len(raw) > EVENT_LINE_LIMIT:
        raise BadRecord(f"a line of {len(raw)} bytes (the limit is {EVENT_LINE_LIMIT})")
    try:
        obj = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as err:
        raise BadRecord(f"not JSON: {str(err)[:200]}") from None
    if not isinstance(obj, dict):
        raise BadRecord(f"not a JSON object but {type(obj).__name__}")
    try:
        msgspec.convert(obj, EventFields)
    except msgspec.ValidationError as err:
        raise BadRecord(str(err)[:200]) from None
    for name in _REQUIRED.get(obj["event"], ()):
        if obj.get(name) is None:
            raise BadRecord(f"a {obj['event']} event without {name}")
    return obj
