"""Fuzzing the node monitor's two inputs (issue 10): the timer pipe and the shared-memory
segment, each with >= 10,000 hostile messages while real workers run.

Promises checked: the monitor lives (both threads), never signals a process that is not
a worker of the attempt, reports no false hang, and still catches a real hang within its
timeout + 1 s. Seeded: a failure prints its seed; rerun with STALWART_FUZZ_SEED=<seed>.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stalwart.monitor import ControlAction, HangKind, HangReport, MonitorConfig, layout
from stalwart.monitor.wire import PIPE_BUF, ControlMessage, TimerMessage, encode
from tests.helpers import wait_for

from ..monitor.conftest import Harness

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(180)]

MESSAGES = 12_000
SEED = int(os.environ.get("STALWART_FUZZ_SEED", str(random.randrange(1 << 30))))


def _alive_threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def _write_all(fd: int, data: bytes, deadline: float) -> None:
    """Whole-buffer write to a non-blocking pipe (waits while the server drains it)."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            assert time.monotonic() < deadline, "the monitor stopped draining its pipe"
            time.sleep(0.0005)


def _junk_line(rng: random.Random, pids: list[int]) -> bytes:
    """One hostile line (always newline-terminated, see docs/monitor.md "Known limits")."""
    pid = rng.choice(pids)
    kind = rng.randrange(12)
    past = time.time() - rng.random()
    if kind == 0:
        return b"\n" * rng.randrange(1, 200)
    if kind == 1:
        return (
            bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))).replace(b"\n", b" ")
            + b"\n"
        )
    if kind == 2:
        depth = rng.randrange(500, (PIPE_BUF - 20) // 2)
        return b'{"pid":' + b"[" * depth + b"]" * depth + b"}\n"
    if kind == 3:
        return b"x" * rng.randrange(PIPE_BUF, 3 * PIPE_BUF) + b"\n"
    if kind == 4:  # an expired timer naming a non-worker, with any signal at all
        sig = rng.choice([0, -3, 9, 15, 19, 99, 2**40])
        return encode(TimerMessage(pid, f"fuzz{rng.randrange(10**6)}", past, 0)).replace(
            b'"signal":0', f'"signal":{sig}'.encode()
        )
    if kind == 5:  # a control request from a non-worker
        action = rng.choice(list(ControlAction))
        return encode(ControlMessage(pid, rng.choice([None, 0, 1, -1]), action))
    if kind == 6:  # well-formed JSON of the wrong shape
        body = {
            "version": rng.choice([1, 2, "1", None]),
            "pid": rng.choice([pid, -pid, 0, 2**70, "1", 1.5, None, True]),
            "scope_id": rng.choice(["s", 5, None, ["a"]]),
            "expiration_time": rng.choice([past, math.inf, -1, "now", None, 1e308]),
            "signal": rng.choice([9, 99, -1, "KILL", None, 1.5]),
            "type": rng.choice(["timer", "control", "other", None]),
            "action": rng.choice(["shutdown_workload", "exclude_node", "boom", None]),
        }
        return json.dumps(body, allow_nan=True).encode() + b"\n"
    if kind == 7:  # timers for pids that do not exist (the table must stay small)
        return encode(TimerMessage(rng.randrange(4_000_000, 2**31 - 1), "ghost", past + 600, 9))
    if kind == 8:
        return b'{"version":1,' * rng.randrange(1, 50) + b"\n"
    if kind == 9:
        return b"\x00" * rng.randrange(1, 100) + b"\n"
    if kind == 10:  # many scopes for one non-worker, far in the future
        return encode(TimerMessage(pid, f"many{rng.randrange(10**9)}", past + 600, 9))
    return b" \t \n"


def test_timer_pipe_fuzz(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    h = Harness(tmp_path)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        hb_timeout = 3.0
        mon = h.start(
            MonitorConfig(
                check_interval=0.05, stack_dump_wait=0.2, term_grace=1.0, hb_timeout=hb_timeout
            ),
            nranks=3,
        )
        healthy = h.spawn(0, "healthy", "100000", "0.02")
        by_timer = h.spawn(1, "healthy", "100000", "0.02")  # beats on; only a timer hangs it
        by_hb = h.spawn(2, "stop_heartbeat")  # beats three times, then only sleeps
        mon.begin_attempt(0, {0: healthy.pid, 1: by_timer.pid, 2: by_hb.pid})
        for lr in range(3):
            h.wait_ready(lr)
        mm, _ = layout.open_segment(mon.shm_path)
        hb_due = layout.read_slot(mm, 2).last_hb + hb_timeout + time.time() - time.monotonic()
        mm.close()
        # Everything a request could name that is not a worker: a bystander, init, the
        # launcher itself (this process), its parent, a pid that no longer exists.
        others = [bystander.pid, 1, os.getpid(), os.getppid(), gone.pid]
        fd = os.open(mon.pipe_path, os.O_WRONLY | os.O_NONBLOCK)
        deadline = time.monotonic() + 120
        timer_due = math.inf
        sent = 0
        t0 = time.monotonic()
        try:
            # At least MESSAGES, and on until past both real hangs' deadlines: they must
            # be caught while the flood goes on.
            while sent < MESSAGES or time.time() < max(timer_due, hb_due) + 1.2:
                batch = b"".join(_junk_line(rng, others) for _ in range(50))
                _write_all(fd, batch, deadline)
                sent += 50
                if sent == MESSAGES // 2:
                    # A real hang: a rank's own timer, in the middle of the flood.
                    timer_due = time.time() + 1.5
                    line = encode(TimerMessage(by_timer.pid, "real", timer_due, signal.SIGTERM))
                    _write_all(fd, line, deadline)
            flood_s = time.monotonic() - t0
        finally:
            os.close(fd)
        found: list[HangReport] = []

        def both_reported() -> bool:
            found.extend(mon.poll_hangs())
            return len(found) >= 2

        wait_for(both_reported, 30, "both real hangs to be reported")
        # Half a second of the monitor's own scans after the reports: nothing more.
        assert mon.wait_scanned_since(time.monotonic() + 0.5, 30), "the monitor stopped"
        found.extend(mon.poll_hangs())
        detail = f"seed {SEED}, {sent} messages in {flood_s:.1f} s"
        by_pid = {r.pid: r for r in found}
        assert sorted(by_pid) == sorted([by_timer.pid, by_hb.pid]) and len(found) == 2, detail
        timer_hang, hb_hang = by_pid[by_timer.pid], by_pid[by_hb.pid]
        assert timer_hang.kind is HangKind.TIMER and timer_hang.section == "real", detail
        assert hb_hang.kind is HangKind.HEARTBEAT, detail
        late = (timer_hang.detected_at - timer_due, hb_hang.detected_at - hb_due)
        assert max(late) < 1.0, f"caught {late[0]:.2f} s / {late[1]:.2f} s late; {detail}"
        assert by_timer.wait(timeout=10) == -signal.SIGTERM
        assert healthy.poll() is None and bystander.poll() is None, detail
        assert mon.poll_requests() == [], detail
        assert {"stalwart-monitor", "stalwart-timer-server"} <= _alive_threads(), detail
        assert mon._timers.active_timers < 5000, detail  # type: ignore[attr-defined]
        print(
            f"timer-pipe fuzz: {detail}; timer hang caught {late[0]:+.3f} s after expiry, "
            f"heartbeat hang {late[1]:+.3f} s after its deadline"
        )
    finally:
        h.close()
        bystander.kill()
        bystander.wait()


HOSTILE_F64 = [
    -1.0, -0.0, -math.inf, math.inf, math.nan, 5e-324, -5e-324, 1e-9, 1e-300, 1e300,
    2.2250738585072014e-308, float.fromhex("0x1.fffffffffffffp+1023"),
]  # fmt: skip
F64_FIELDS = [
    layout.OFF_ATTACH, layout.OFF_LAST_HB, layout.OFF_OOS_START, layout.OFF_HB_INITIAL,
    layout.OFF_HB, layout.OFF_OOS,
    *(layout.OFF_OPEN + 8 * i for i in range(layout.MAX_SECTIONS)),
    *(layout.OFF_LIMIT + 8 * i for i in range(layout.MAX_SECTIONS)),
]  # fmt: skip
I64_FIELDS = [layout.OFF_ITERATION, layout.OFF_LAST_SECTION, layout.OFF_NAME_COUNT]


def test_shared_memory_fuzz(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    h = Harness(tmp_path)
    try:
        hb_timeout = 2.0
        mon = h.start(
            MonitorConfig(
                check_interval=0.05,
                stack_dump_wait=0.2,
                term_grace=1.0,
                hb_timeout=hb_timeout,
                out_of_section_timeout=30,
                section_timeouts={"step": 30},
            ),
            nranks=3,
        )
        healthy = h.spawn(0, "healthy", "100000", "0.02")
        hung = h.spawn(2, "stop_heartbeat")
        # Slot 1 has no worker: anything written there must be ignored.
        mon.begin_attempt(0, {0: healthy.pid, 2: hung.pid})
        h.wait_ready(0)
        h.wait_ready(2)
        mm, _ = layout.open_segment(mon.shm_path)
        to_wall = time.time() - time.monotonic()
        hung_last_hb = layout.read_slot(mm, 2).last_hb
        assert hung_last_hb > 0
        due = hung_last_hb + hb_timeout + to_wall
        writes = 0
        t0 = time.monotonic()
        try:
            while writes < MESSAGES:
                for _ in range(40):
                    target = rng.randrange(3)
                    if target == 0:  # the healthy rank: out-of-range numbers only
                        off = layout.slot_offset(0) + rng.choice(F64_FIELDS)
                        if rng.random() < 0.8:
                            struct.pack_into("=d", mm, off, rng.choice(HOSTILE_F64))
                        else:
                            field = layout.slot_offset(0) + rng.choice(I64_FIELDS)
                            struct.pack_into("=q", mm, field, rng.randrange(-(2**63), 2**63))
                    elif target == 1:  # the free slot: anything at all
                        off = layout.slot_offset(1) + rng.randrange(layout.SLOT_SIZE - 8)
                        mm[off : off + 8] = rng.randbytes(8)
                    else:  # the header
                        off = rng.randrange(layout.HEADER_SIZE - 8)
                        mm[off : off + 8] = rng.randbytes(8)
                    writes += 1
                time.sleep(0.005)  # spread over seconds, so many scans see the damage
            fuzz_s = time.monotonic() - t0
        finally:
            mm.close()
        found: list[HangReport] = []

        def hung_reported() -> bool:
            found.extend(mon.poll_hangs())
            return bool(found)

        wait_for(hung_reported, 30, "the real hang to be reported")
        # Half a second of the monitor's own scans after the reports: nothing more.
        assert mon.wait_scanned_since(time.monotonic() + 0.5, 30), "the monitor stopped"
        found.extend(mon.poll_hangs())
        detail = f"seed {SEED}, {writes} writes in {fuzz_s:.1f} s"
        assert [r.pid for r in found] == [hung.pid], detail
        assert found[0].kind is HangKind.HEARTBEAT, detail
        late = found[0].detected_at - due
        assert late < 1.0, f"caught {late:.2f} s late; {detail}"
        assert healthy.poll() is None, detail
        assert "stalwart-monitor" in _alive_threads(), detail
        assert any(e == "monitor_bad_slot" for e, _ in h.events), detail
        # The scribbled header does not fail the next attempt's workers.
        mon.end_attempt()
        for p in (healthy, hung):
            p.kill()
            p.wait()
        nxt = h.spawn(0, "healthy", "3", "0.01")
        mon.begin_attempt(1, {0: nxt.pid})
        assert nxt.wait(timeout=30) == 0, h.stderr_path(0).read_text()[-2000:]
        print(f"shared-memory fuzz: {detail}; hang caught {late:+.3f} s after its deadline")
    finally:
        h.close()
