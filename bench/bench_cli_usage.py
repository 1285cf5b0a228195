"""How long a usage error takes to be answered: ``stalwart run`` and ``torchrun`` given
``--nproc-per-node x``, interleaved, medians of wall time (start to exit).

    python bench/bench_cli_usage.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STALWART = [sys.executable, "-m", "stalwart.cli", "run"]
BAD = ["--nproc-per-node", "x", "train.py"]


def wall(cmd: list[str]) -> float:
    t = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t
    if proc.returncode == 0:
        raise SystemExit(f"{cmd[:4]} took the bad value: {proc.stdout[-300:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    rows: dict[str, list[float]] = {"torchrun": [], "stalwart run": []}
    for _ in range(args.repeats):
        rows["torchrun"].append(wall([*TORCHRUN, *BAD]))
        rows["stalwart run"].append(wall([*STALWART, *BAD]))
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"load: {load}")
    print("| usage error (--nproc-per-node x) | median (s) | runs (s) |")
    print("|---|---|---|")
    for name, times in rows.items():
        runs = ", ".join(f"{t:.2f}" for t in times)
        print(f"| {name} | {statistics.median(times):.2f} | {runs} |")
    ratio = statistics.median(rows["stalwart run"]) / statistics.median(rows["torchrun"])
    print(f"stalwart / torchrun: {ratio:.2f}")


if __name__ == "__main__":
    main()
