"""What a line of ``events.jsonl`` must be for ``report``, goodput, the timeline and
the metrics to use it.

The file holds lines the launcher wrote, lines workers wrote (``stalwart.runlog``), and
whatever else reached it: an older version, a hand edit, a worker's bug. Each line is
decoded with msgspec and checked against ``EventFields`` (the fields the readers index,
with the types and ranges they assume); a line that does not fit is skipped, never
half-used, and its reader warns once.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from stalwart.base.records import EVENT_LINE_LIMIT

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
    # launcher_start: when the launcher's process began (goodput's start)
    process_start: Time | None = None
    # node_quarantined / node_released (reporting/quarantine.py)
    node: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    since_attempt: Attempt | None = None


# Kinds whose readers index a field without a default: the field must be there.
_REQUIRED = {
    "worker_spawn": ("rank",),
    "hang_detected": ("global_rank",),
    "progress": ("step",),
    "node_quarantined": ("node",),
    "node_released": ("node",),
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
