"""The worker's side of the run's event log: a few events only a worker knows.

Under ``stalwart run`` the launcher names its ``events.jsonl`` in ``STALWART_EVENTS_FILE``;
a worker appends whole lines to it with one ``O_APPEND`` write each, so its records
interleave cleanly with the launcher's.  Without the variable (plain torchrun, or a run
with ``--log-dir /dev/null``) every call here is a no-op.  This module imports nothing
from ``launch``: checkpointing, fault injection and the framework callbacks use it from
inside workers.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from stalwart.base import envvars
from stalwart.base.events import Event
from stalwart.base.records import bounded

#: Path of the run's events.jsonl, set by the launcher in every worker's environment.
EVENTS_FILE_ENV = "STALWART_EVENTS_FILE"

# The kinds a worker writes (spelled in ``base.events``; named here for the worker side).
FAULT_INJECTED = Event.FAULT_INJECTED
CHECKPOINT_COMMIT = Event.CHECKPOINT_COMMIT
CHECKPOINT_RESTORED = Event.CHECKPOINT_RESTORED


def _context() -> dict[str, Any]:
    fields: dict[str, Any] = {"host": socket.gethostname()}
    for key, env, conv in (
        ("run_id", envvars.RUN_ID, str),
        ("rank", envvars.RANK, int),
        ("local_rank", envvars.LOCAL_RANK, int),
        ("attempt", envvars.RESTART_COUNT, int),
    ):
        raw = os.environ.get(env)
        if raw is not None:
            try:
                fields[key] = conv(raw)
            except ValueError:
                continue
    return fields


def emit(event: Event, **fields: Any) -> bool:
    """Appends one event to the run's log; returns False when there is none to write to.

    A failure to write is swallowed: an event must never break a training job.
    """
    path = os.environ.get(EVENTS_FILE_ENV)
    if not path:
        return False
    now = time.time()
    record = {
        "event": event,
        "time": now,
        "mono": time.monotonic(),
        "pid": os.getpid(),
        "source": "worker",
        **_context(),
        **{k: bounded(v) for k, v in fields.items()},
    }
    line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return False
    try:
        os.write(fd, line)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True
