"""What validating every event line costs: ``stalwart report``'s reader (msgspec decode +
typed check, streamed with a line cap) against the plain ``json.loads`` loop it replaced,
on the same generated ``events.jsonl`` (progress-heavy, like a long run's), with peak
memory of each in a fresh process.

    python bench/bench_records_read.py --mib 50 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLAIN = """
import json, resource, sys, time
t = time.perf_counter(); n = 0
with open(sys.argv[1], encoding="utf-8") as fh:
    events = []
    for line in fh:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            events.append(obj)
print(time.perf_counter() - t, len(events), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

STALWART = """
import resource, sys, time
from stalwart.reporting.read import read_events
t = time.perf_counter()
events = list(read_events(sys.argv[1]))
print(time.perf_counter() - t, len(events), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

STALWART_STREAM = """
import resource, sys, time
from stalwart.reporting.read import last_run_start
t = time.perf_counter()
start = last_run_start(sys.argv[1])
print(time.perf_counter() - t, start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def make_file(path: Path, mib: int) -> int:
    t0 = time.time() - 86400
    n = 0
    with open(path, "w") as fh:
        while fh.tell() < mib << 20:
            fh.write(
                json.dumps(
                    {"event": "progress", "time": t0 + n * 0.01, "mono": n * 0.01, "pid": 1,
                     "run_id": "bench", "host": "h", "attempt": 0, "rank": n % 8,
                     "local_rank": n % 8, "step": n // 8, "step_time": t0 + n * 0.01}
                ) + "\n"
            )  # fmt: skip
            n += 1
    return n


def run(code: str, path: Path) -> tuple[float, int, float]:
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
    ).stdout.split()
    return float(out[0]), int(out[1]), int(out[2]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ns = ap.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="stalwart-bench-records-") as tmp:
        path = Path(tmp) / "events.jsonl"
        lines = make_file(path, ns.mib)
        rows: dict[str, list[tuple[float, int, float]]] = {
            "json.loads loop (before)": [],
            "read_events (validated)": [],
            "last_run_start (scan only)": [],
        }
        for _ in range(ns.repeats):  # interleaved: the machine is shared
            rows["json.loads loop (before)"].append(run(PLAIN, path))
            rows["read_events (validated)"].append(run(STALWART, path))
            rows["last_run_start (scan only)"].append(run(STALWART_STREAM, path))
    base = statistics.median(r[0] for r in rows["json.loads loop (before)"])
    print(f"{ns.mib} MiB, {lines} lines, {ns.repeats} repeats, load {load[0]:.2f} {load[1]:.2f}")
    print("| reader | seconds (min / median / max) | ÷ json.loads | peak RSS MiB (median) |")
    print("|---|---|---|---|")
    for name, rs in rows.items():
        secs = sorted(r[0] for r in rs)
        med = statistics.median(secs)
        rss = statistics.median(r[2] for r in rs)
        print(
            f"| {name} | {secs[0]:.2f} / {med:.2f} / {secs[-1]:.2f} | {med / base:.2f} | {rss:.0f} |"
        )


if __name__ == "__main__":
    main()
