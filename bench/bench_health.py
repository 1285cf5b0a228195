"""What node health checks add to a round, on simulated hosts (network namespaces).

N = 2, 4, 8 nodes start at once, each a ``stalwart run`` of a worker that stamps the
moment its process group and DDP model are up (``rdzv_stamp.py``); once without and once
with ``--node-health``, side by side in each repeat. Printed per N: each node's check
time (its own checks, the echo timing and the collective link check, waiting for its
process's torch import included, from its ``health_checked`` event; the round waits for
the slowest node), the collective check's own time in its process (``collective_s``), and the time from the start until every worker is up, with
and without the checks. No anchor runs such a check (torchrun has none; NVIDIA's
ft_launcher 0.4.1, the newest here, neither), so the baseline is stalwart without it.

Needs root. ``python bench/bench_health.py [--repeats 3] [--nodes 2,4,8] [--markdown]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from common import fmt, kill_leftovers, machine, med, ratio, show, spread  # noqa: E402
from netns import JOB_SECRET, Host, Network, free_port, netns_usable, rdzv_args  # noqa: E402

STAMP = HERE / "rdzv_stamp.py"
CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=30,join_timeout=120"


def once(
    hosts: list[Host], work: Path, health: bool, breakdown: dict[str, list[float]]
) -> tuple[float | None, list[float], list[float]]:
    """(seconds until every worker is up, each node's check seconds, each node's
    collective link check seconds in its process); each node's `PARTS` go to
    *breakdown*."""
    n = len(hosts)
    endpoint = f"{hosts[0].addr}:{free_port()}"
    stamps = work / "stamps"
    stamps.mkdir(parents=True)
    rdzv_id = f"bh{time.monotonic_ns()}"
    t0 = time.time()
    procs = []
    for i, h in enumerate(hosts):
        args = rdzv_args(
            backend="c10d", endpoint=endpoint, nnodes=str(n), run_id=rdzv_id, conf=CONF
        )
        procs.append(
            h.spawn(
                sys.executable, "-m", "stalwart.cli", "run", *args,
                *(["--node-health"] if health else []),
                "--log-dir", work / f"logs{i}", STAMP, stamps,
                log=work / f"n{i}.out", extra_env={"STALWART_JOB_SECRET": JOB_SECRET},
            )
        )  # fmt: skip
    ok = True
    try:
        deadline = time.monotonic() + 240
        for p in procs:
            try:
                ok &= p.wait(max(1.0, deadline - time.monotonic())) == 0
            except subprocess.TimeoutExpired:
                ok = False
    finally:
        for h in hosts:
            h.stop()
        kill_leftovers(work)
    got = [float(f.read_text()) for f in stamps.glob("stamp_*")]
    checks = []
    collective = []
    for f in work.glob("logs*/*/events.jsonl"):
        for line in f.read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "health_checked":
                checks.append(float(e["seconds"]) + float(e.get("links_s", 0.0)))
                if "collective_s" in e:
                    collective.append(float(e["collective_s"]))
                    e["stages_s"] = float(e["collective_s"]) - float(e.get("collective_ready_s", 0))
                if "collective_total_s" in e:
                    e["echo_s"] = float(e.get("links_s", 0)) - float(e["collective_total_s"])
                for part in PARTS:
                    if part in e:
                        breakdown.setdefault(part, []).append(float(e[part]))
                if "collective_start" in e:
                    breakdown.setdefault("warm", []).append(e["collective_start"] == "template")
                if e.get("collective_void"):
                    print(f"  collective check void: {e['collective_void']}", flush=True)
            if e["event"] == "node_excluded":
                print(f"  FALSE EXCLUSION in a healthy run: {e['reasons']}", flush=True)
    if not ok or len(got) != n:
        print(f"  a run failed; logs: {work}", flush=True)
        return None, checks, collective
    return max(got) - t0, checks, collective


#: Where a node's check time goes (``health_checked``): its own checks (compute bursts,
#: memory, disk, interface), the wait for the check's members to be sealed, for its
#: process to exist (forked from the template), for every member's process to be ready
#: (the roster; a cold process's torch import shows here), and the stages themselves.
PARTS = {
    "seconds": "own checks",
    "echo_s": "echo timing",
    "collective_gather_s": "members sealed",
    "collective_fork_wait_s": "wait for the fork",
    "collective_ready_s": "members ready",
    "stages_s": "stages",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nodes", default="2,4,8")
    ap.add_argument("--markdown", action="store_true")
    ns = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = netns_usable()
    if why:
        print(f"skipped: {why}")
        return 0
    print(machine())
    rows = []
    breakdown_rows: list[list[str]] = []
    for n in [int(x) for x in ns.nodes.split(",")]:
        net = Network(f"{os.getpid() % 10000}")
        base = Path(tempfile.mkdtemp(prefix="bench_health_"))
        plain: list[float] = []
        checked: list[float] = []
        per_node: list[float] = []
        in_proc: list[float] = []
        slowest: list[float] = []
        parts: dict[str, list[float]] = {}
        loads = []
        try:
            hosts = [net.add_host() for _ in range(n)]
            for r in range(ns.repeats):
                loads.append(os.getloadavg()[0])
                up, _, _ = once(hosts, base / f"plain{r}", health=False, breakdown={})
                up_h, checks, coll = once(hosts, base / f"health{r}", health=True, breakdown=parts)
                in_proc += coll
                if up is not None:
                    plain.append(up)
                if up_h is not None:
                    checked.append(up_h)
                per_node += checks
                if checks:
                    slowest.append(max(checks))
                print(f"  N={n} #{r}: up {fmt(up)} -> {fmt(up_h)} with checks; "
                      f"slowest check {fmt(max(checks) if checks else None)}; "
                      f"load {loads[-1]:.1f}", flush=True)  # fmt: skip
        finally:
            net.close()
            shutil.rmtree(base, ignore_errors=True)
        warm = parts.pop("warm", [])
        print(f"  N={n} where a node's check time goes (median): " + ", ".join(
            f"{PARTS[k]} {fmt(med(v))}" for k, v in parts.items()
        ) + f"; forked from the template: {sum(warm)}/{len(warm)}", flush=True)  # fmt: skip
        breakdown_rows.append([str(n), *(fmt(med(parts.get(k, []))) for k in PARTS),
                               f"{sum(warm)}/{len(warm)}"])  # fmt: skip
        rows.append([
            str(n), spread(per_node), spread(slowest), spread(in_proc), fmt(med(plain)),
            fmt(med(checked)),
            ratio(med(checked), med(plain)), f"{min(loads):.1f}-{max(loads):.1f}",
        ])  # fmt: skip
    show(
        "node health checks: what they add to a round (netns hosts, gloo on CPU)",
        ["nodes", "check per node (min/med/max)", "slowest node per round",
         "collective check in its process", "all workers up, no checks",
         "with --node-health", "ratio", "load (1 min)"],
        rows, ns.markdown,
    )  # fmt: skip
    show(
        "where a node's check goes (medians over nodes and repeats)",
        ["nodes", *PARTS.values(), "check forked from the template"],
        breakdown_rows, ns.markdown,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
