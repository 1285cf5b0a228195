"""Drives a ``WarmPool`` as the launcher does, and begins its teardown (``close()``, from
another thread) at the moment a learned template takes over from the serving one.
Prints one JSON line: which template processes were alive when ``close()`` returned,
the events (and whether each came after that), and what is left afterwards.

    takeover.py TEMPLATE_LOG HOLD_S

HOLD_S bounds how long the takeover waits for ``close()`` to finish: a pool whose
teardown is ordered cannot finish while a takeover is under way, and the takeover then
goes on after HOLD_S."""

import json
import os
import sys
import threading
from typing import Any

import psutil

from stalwart.base import procs
from stalwart.base.events import Event
from stalwart.launch.workers.warm import WarmPool

procs.set_child_subreaper()  # as the launcher: forked templates are re-parented to us
hold_s = float(sys.argv[2])
close_done = threading.Event()
seen: set[int] = set()
log: list[list[Any]] = []
result: dict[str, Any] = {}
pool: WarmPool


def closer() -> None:
    pool.close()
    result["alive_at_return"] = sorted(p for p in seen if procs.is_alive(p))
    close_done.set()


def emit(kind: Event, **fields: Any) -> None:
    log.append([str(kind.value), close_done.is_set()])
    pid = fields.get("template_pid")
    if pid:
        seen.add(int(pid))
    if kind == Event.TEMPLATE_READY and fields.get("learned") is not None:
        threading.Thread(target=closer).start()
        close_done.wait(hold_s)


pool = WarmPool([], dict(os.environ), emit, log_path=sys.argv[1])
if not pool.ensure():
    sys.exit(f"no template: {pool.disabled_reason}")
pool._learn(["json"])  # what a worker's report does
if not close_done.wait(120):
    sys.exit("close() did not return")
pool._learn(["csv"])  # a late report: must fork nothing
result["events"] = log
result["children"] = [
    c.pid for c in psutil.Process().children() if c.status() != psutil.STATUS_ZOMBIE
]
result["alive_later"] = sorted(p for p in seen if procs.is_alive(p))
print(json.dumps(result), flush=True)
