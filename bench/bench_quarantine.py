"""Quarantine on simulated hosts: a 3-node elastic job (``--nnodes 2:3``) in which one
node's rank dies at step 5 of every attempt, with quarantine (the default 3/5) and
without it (``--quarantine-after off``).  Prints, per setting, how often the job
finished, the median time from start to the last launcher's exit, and attempts used.
Without quarantine the crash-loop verdict ends the job (exit 93) after 3 attempts; with
it the bad node leaves after its third failed round and the other two finish.

Needs root (network namespaces).  ``python bench/bench_quarantine.py [--repeats 3] [--markdown]``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from common import fmt, machine, med, show  # noqa: E402
from netns import Network, netns_usable, rdzv_args  # noqa: E402

JOB = HERE / "quarantine_train.py"
CONF = (
    "keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=3,"
    "join_timeout=60,close_timeout=5"
)


def one_run(tag: str, quarantine: str, work: Path) -> tuple[bool, float, int]:
    """(finished, seconds to the last exit, attempts) of one job."""
    net = Network(tag)
    try:
        hosts = [net.add_host() for _ in range(3)]
        endpoint = f"{hosts[0].addr}:29512"
        t0 = time.monotonic()
        procs = []
        for i, h in enumerate(hosts):
            args = rdzv_args(
                backend="c10d", endpoint=endpoint, nnodes="2:3", run_id="qb", conf=CONF,
                max_restarts=6,
            )  # fmt: skip
            procs.append(
                h.stalwart(
                    *args,
                    "--quarantine-after",
                    quarantine,
                    "--shutdown-timeout",
                    "3",
                    "--log-dir",
                    work / f"logs{i}",
                    JOB,
                    log=work / f"n{i}.out",
                    extra_env={"QUARANTINE_BAD": "1"} if i == 2 else None,
                )
            )
        codes = [p.wait(timeout=300) for p in procs]
        wall = time.monotonic() - t0
        finished = codes[0] == 0 and codes[1] == 0
        events = next((work / "logs0").iterdir()) / "events.jsonl"
        attempts = events.read_text().count('"event":"rendezvous_done"')
        return finished, wall, attempts
    finally:
        net.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", action="store_true")
    ns = ap.parse_args()
    why = netns_usable()
    if why:
        sys.exit(f"bench_quarantine: {why}")
    print(machine())
    rows = []
    for setting in ("3/5", "off"):
        runs = []
        for r in range(ns.repeats):
            load = os.getloadavg()[0]
            with tempfile.TemporaryDirectory(prefix="swq") as d:
                tag = str((os.getpid() + r + (0 if setting == "off" else 50)) % 10000)
                runs.append((*one_run(tag, setting, Path(d)), load))
        rows.append(
            [
                f"--quarantine-after {setting}",
                f"{sum(1 for f, *_ in runs if f)}/{len(runs)}",
                fmt(med([w for _, w, _, _ in runs])),
                str(sorted({a for _, _, a, _ in runs})),
                " ".join(f"{ld:.1f}" for *_, ld in runs),
            ]
        )
    show(
        "3 nodes (--nnodes 2:3), one whose rank dies at step 5 of every attempt",
        ["setting", "finished", "median wall", "attempts", "load (1 min) per run"],
        rows,
        ns.markdown,
    )


if __name__ == "__main__":
    main()
