"""Launcher overhead on a trivial job, and what the interpreter's exit with torch costs.

Two rows side by side with the anchor, interleaved, medians of wall time:

* ``stalwart run`` and ``torchrun --standalone`` running ``--no-python true`` on 2 ranks:
  the whole command, start to exit (what every end-to-end test pays once);
* a bare ``python -c 'import torch.distributed'``: the time after the import returns
  (interpreter start-up and exit), as is and with ``gc.freeze()`` after the import, as
  ``stalwart run`` does (torch's objects then take no part in the final collection).

    python bench/bench_launcher_exit.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STALWART = [sys.executable, "-m", "stalwart.cli", "run"]
JOB = ["--nproc-per-node", "2", "--no-python", "true"]

IMPORT_THEN = """
import sys, time
t = time.monotonic()
import torch.distributed
{after}
sys.stderr.write(f"{{time.monotonic() - t}}\\n")
"""


def wall(cmd: list[str], cwd: Path) -> float:
    t = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} exited {proc.returncode}: {proc.stderr[-500:]}")
    return time.monotonic() - t


def after_import(after: str) -> float:
    """Seconds the process lives besides importing torch.distributed."""
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_THEN.format(after=after)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return time.monotonic() - t - float(proc.stderr.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows: dict[str, list[float]] = {
        "torchrun --standalone, trivial job": [],
        "stalwart run, trivial job": [],
        "python: start-up + exit with torch loaded": [],
        "python: the same after gc.freeze()": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i in range(args.repeats):
            rows["torchrun --standalone, trivial job"].append(
                wall([*TORCHRUN, "--standalone", *JOB], work)
            )
            rows["stalwart run, trivial job"].append(
                wall([*STALWART, "--log-dir", str(work / str(i)), *JOB], work)
            )
            rows["python: start-up + exit with torch loaded"].append(after_import("pass"))
            rows["python: the same after gc.freeze()"].append(
                after_import("import gc; gc.freeze()")
            )
    print("| what | median (s) | runs (s) |")
    print("|---|---|---|")
    for name, times in rows.items():
        runs = ", ".join(f"{t:.2f}" for t in times)
        print(f"| {name} | {statistics.median(times):.2f} | {runs} |")


if __name__ == "__main__":
    main()
