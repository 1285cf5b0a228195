"""The user's own check (``--node-health-check CMD``): an exit status and a reason.

The command runs through ``/bin/sh -c`` in a session of its own, so at its timeout its
whole process group is killed, children included. Exit 0 passes; any other status (or
a timeout) fails, with the reason the command gave on the first line of its standard
output as one JSON object (``{"reason": "..."}``), or the line itself. At most
`OUTPUT_LIMIT` bytes are read; the rest is drained and dropped.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time

from stalwart.health.records import PROBLEM_LIMIT

OUTPUT_LIMIT = 4096


def _reason(out: bytes) -> str:
    line = out.split(b"\n", 1)[0].decode(errors="replace").strip()
    try:
        doc = json.loads(line)
    except ValueError:
        return line
    if isinstance(doc, dict) and isinstance(doc.get("reason"), str):
        return str(doc["reason"])
    return line


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_user_check(cmd: str, timeout: float, env: dict[str, str] | None = None) -> str | None:
    """None when *cmd* passes; else the problem, one line."""
    short = cmd if len(cmd) <= 80 else cmd[:77] + "..."
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", cmd],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
    except OSError as err:
        return f"health check `{short}` could not start: {err.strerror}"
    assert proc.stdout is not None
    out = bytearray()
    deadline = time.monotonic() + timeout
    timed_out = False
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                if not sel.select(min(left, 0.5)):
                    continue
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break  # every writer closed its end
                if len(out) < OUTPUT_LIMIT:
                    out += chunk[: OUTPUT_LIMIT - len(out)]
            if not timed_out:
                left = max(0.0, deadline - time.monotonic())
                try:
                    proc.wait(left)
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            # The group goes in every case: a check that exited may have left children.
            _kill_group(proc)
            proc.stdout.close()
            proc.wait()
    if timed_out:
        return f"health check `{short}` did not finish within {timeout:g}s (killed)"
    if proc.returncode == 0:
        return None
    why = _reason(bytes(out))
    status = (
        f"was killed by {signal.Signals(-proc.returncode).name}"
        if proc.returncode < 0
        else f"exited {proc.returncode}"
    )
    text = f"health check `{short}` {status}" + (f": {why}" if why else "")
    return text[:PROBLEM_LIMIT]
