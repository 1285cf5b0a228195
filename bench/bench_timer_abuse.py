"""What abuse of the timer pipe costs the node's timer server (issue 10 item 6).

    .venv/bin/python bench/bench_timer_abuse.py [--repeats 3]
    PYTHONPATH=/path/to/other/src .venv/bin/python bench/bench_timer_abuse.py   # compare

Two trials, medians over repeats:
- 200,000 timers for pids that do not exist, sent as fast as the pipe takes them:
  timers kept, server CPU seconds, peak RSS growth (MB).
  Then the server's CPU use over 2 s with nothing arriving (the table as it was left).
- an expired timer of a live process under a flood of empty lines (written as fast as
  the server drains them): seconds from its expiry to the server handing it over for
  reaping (30 s cap).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from stalwart.monitor.timer_server import ExpiredTimer, TimerServer
from stalwart.monitor.wire import TimerMessage, encode

WRITER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY)
mode = sys.argv[2]
if mode == "dead":
    far = time.time() + 3600
    start = 4_000_000
    batch = []
    for i in range(200_000):
        pid = 2**31 - 2 - i
        batch.append(('{"version":1,"pid":%d,"scope_id":"s","expiration_time":%r,"signal":9}\\n' % (pid, far)).encode())
        if len(batch) == 40:
            os.write(fd, b"".join(batch)); batch = []
else:
    block = b"\\n" * 65536
    end = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < end:
        os.write(fd, block)  # blocking: as fast as the server drains
"""


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def dead_pids(tmp: Path) -> tuple[int, float, float, float]:
    srv = TimerServer(tmp / "p", on_expired=lambda t: None)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    srv.start()
    c0 = cpu()
    subprocess.run([sys.executable, "-c", WRITER, str(srv.path), "dead"], check=True)
    time.sleep(0.5)  # let the server finish the backlog
    used = cpu() - c0
    kept = srv.active_timers
    c1 = cpu()
    time.sleep(2.0)
    idle = (cpu() - c1) / 2.0 * 100
    srv.stop()
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    return kept, used, rss, idle


def flood_delay(tmp: Path) -> float:
    done = threading.Event()
    got: list[float] = []

    def on_expired(t: ExpiredTimer) -> None:
        got.append(time.time())
        done.set()

    srv = TimerServer(tmp / "f", on_expired=on_expired)
    srv.start()
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(srv.path), "flood", "40"])
    try:
        time.sleep(1.0)
        due = time.time() + 0.5
        fd = os.open(srv.path, os.O_WRONLY)
        os.write(fd, encode(TimerMessage(victim.pid, "x", due, 9)))
        os.close(fd)
        done.wait(30)
        return got[0] - due if got else float("inf")
    finally:
        writer.kill()
        writer.wait()
        victim.kill()
        victim.wait()
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as d:
            rows.append((*dead_pids(Path(d)), flood_delay(Path(d))))
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    print(
        f"200k dead-pid timers: kept {med[0]:.0f}, server CPU {med[1]:.2f} s, "
        f"peak RSS +{med[2]:.1f} MB, then idle CPU {med[3]:.0f} %"
    )
    print(f"expiry -> reap under an empty-line flood: {med[4]:.3f} s (median of {args.repeats})")


if __name__ == "__main__":
    main()
