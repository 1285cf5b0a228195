"""Multi-node benchmark on simulated hosts (network namespaces, one launcher per host).

1. Rendezvous: N = 2, 4, 8 nodes start at once; time until every node's worker has
   started (what a user waits for), for torchrun's c10d, stalwart's c10d and stalwart's
   etcd.  stalwart's own rendezvous time (from its events) is shown beside it.
2. Node loss: a 2-node gloo DDP job (``--nnodes 1:2``) loses a whole host (every process
   in its namespace SIGKILLed at once); time until the survivor runs its first step of
   the new attempt, torchrun vs stalwart, with the same keep-alive settings.

Needs root (network namespaces).  ``python bench/bench_multinode.py [--repeats 3] [--markdown]``
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from common import fmt, machine, med, ratio, show  # noqa: E402
from netns import (  # noqa: E402
    TRAIN,
    Host,
    Network,
    etcd_binary,
    free_port,
    netns_usable,
    rdzv_args,
    start_etcd,
    stop_etcd,
)

STAMP = HERE / "rdzv_stamp.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STALWART = [sys.executable, "-m", "stalwart.cli", "run"]
CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=3,join_timeout=120"


def _launcher(method: str) -> list[str]:
    return TORCHRUN if method == "torchrun c10d" else STALWART


def _rdzv_args(method: str, endpoint: str, is_host: bool, nnodes: str) -> list[str]:
    backend = "etcd" if "etcd" in method else "c10d"
    conf = CONF + (",is_host=1" if is_host else ",is_host=0") if backend == "c10d" else CONF
    return rdzv_args(
        backend=backend,
        endpoint=endpoint,
        nnodes=nnodes,
        run_id=f"bench{time.monotonic_ns()}",
        conf=conf,
    )


def _start(
    method: str, hosts: list[Host], endpoint: str, nnodes: str, work: Path, script: list[str]
) -> list[subprocess.Popen[str]]:
    rdzv_id = f"bench{time.monotonic_ns()}"
    procs = []
    for i, h in enumerate(hosts):
        args = _rdzv_args(method, endpoint, i == 0, nnodes)
        args[args.index("--rdzv-id") + 1] = rdzv_id
        # torchrun advertises the host name, which resolves outside the namespace.
        args += ["--local-addr", h.addr]
        procs.append(
            h.spawn(
                *_launcher(method),
                *args,
                "--max-restarts",
                "3",
                "--log-dir",
                work / f"logs{i}",
                *script,
                log=work / f"n{i}.out",
                # torchrun says when its rendezvous starts and ends only at INFO.
                extra_env={"LOGLEVEL": "INFO"} if method == "torchrun c10d" else None,
            )
        )
    return procs


_TORCHRUN_LOG = re.compile(
    r"^I\d{4} (\d\d:\d\d:\d\d\.\d+) .*\[default\] (Rendezvous'ing|Rendezvous complete)"
)


def _protocol_time(method: str, work: Path, n: int) -> float | None:
    """From the last node entering the rendezvous to the last node leaving it: the
    protocol's own latency, whatever the launchers' start-up skew."""
    starts, ends = [], []
    if method == "torchrun c10d":
        today = dt.date.today()
        for i in range(n):
            for line in (work / f"n{i}.out").read_text(errors="replace").splitlines():
                m = _TORCHRUN_LOG.match(line)
                if m:
                    t = dt.datetime.combine(today, dt.time.fromisoformat(m.group(1)))
                    stamp = t.replace(tzinfo=dt.UTC).timestamp()
                    (starts if m.group(2) == "Rendezvous'ing" else ends).append(stamp)
    else:
        for f in work.glob("logs*/*/events.jsonl"):
            for line in f.read_text().splitlines():
                e = json.loads(line)
                if e["event"] == "rendezvous_done":
                    ends.append(float(e["time"]))
                    starts.append(float(e["time"]) - float(e["duration"]))
    if len(starts) != n or len(ends) != n:
        return None
    return max(ends) - max(starts)


def rendezvous_once(
    method: str, hosts: list[Host], etcd_ep: str, work: Path
) -> tuple[float | None, float | None]:
    """(seconds until every worker started, the rendezvous protocol's own latency)."""
    n = len(hosts)
    endpoint = etcd_ep if "etcd" in method else f"{hosts[0].addr}:{free_port()}"
    out = work / "stamps"
    out.mkdir(parents=True)
    t0 = time.time()
    procs = _start(method, hosts, endpoint, str(n), work, [str(STAMP), str(out)])
    try:
        deadline = time.monotonic() + 180
        ok = True
        for p in procs:
            try:
                ok &= p.wait(max(1.0, deadline - time.monotonic())) == 0
            except subprocess.TimeoutExpired:
                ok = False
    finally:
        for h in hosts:
            h.stop()
    stamps = [float(f.read_text()) for f in out.glob("stamp_*")]
    if not ok or len(stamps) != n:
        return None, None
    return max(stamps) - t0, _protocol_time(method, work, n)


def node_loss_once(method: str, a: Host, b: Host, etcd_ep: str, work: Path) -> float | None:
    """Seconds from losing a host to the survivor's first step of the next attempt."""
    endpoint = etcd_ep if "etcd" in method else f"{a.addr}:{free_port()}"
    work.mkdir(parents=True)
    procs = _start(method, [a, b], endpoint, "1:2", work, [str(TRAIN), "400", str(work)])
    progress = work / "progress"

    def read() -> tuple[int, int] | None:
        try:
            att, step = progress.read_text().split()
            return int(att), int(step)
        except (FileNotFoundError, ValueError):
            return None

    try:
        deadline = time.monotonic() + 120
        while (got := read()) is None or got[1] < 20:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                print(f"  no progress before the loss; logs: {work}", flush=True)
                return None
            time.sleep(0.01)
        # Rank 0 writes the progress file: lose the other host.  With c10d that is never
        # the store's host (a), whose loss ends the job by design.
        first = [json.loads(x) for x in (work / "attempts.jsonl").read_text().splitlines()]
        rank0_addr = next(r["host_addr"] for r in first if r["rank"] == 0)
        if "etcd" not in method and rank0_addr != a.addr:
            print("  rank 0 is not on the store's host; trial skipped", flush=True)
            return None
        victim = b if rank0_addr == a.addr else a
        attempt0 = got[0]
        t_kill = time.monotonic()
        victim.kill_all()
        deadline = time.monotonic() + 120
        while (got := read()) is None or got[0] == attempt0:
            if time.monotonic() > deadline:
                print(f"  the survivor did not resume within 120 s; logs: {work}", flush=True)
                return None
            time.sleep(0.005)
        return time.monotonic() - t_kill
    finally:
        a.stop()
        b.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nodes", default="2,4,8")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the work folders (logs)")
    ns = ap.parse_args()
    # A SIGTERM must still remove the namespaces and processes (finally blocks below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = netns_usable()
    if why:
        print(f"bench_multinode: skipped: {why}", file=sys.stderr)
        return 0
    binary = etcd_binary()
    methods = ["torchrun c10d", "stalwart c10d"] + (["stalwart etcd"] if binary else [])
    print(f"machine: {machine()}")
    print(f"- rdzv-conf for every launcher: `{CONF}`; 1 worker per node")
    sizes = [int(x) for x in ns.nodes.split(",")]
    rdzv: dict[tuple[str, int], list[float]] = {}
    inner: dict[tuple[str, int], list[float]] = {}
    loss: dict[str, list[float]] = {}
    failures: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="stalwart-mn-"))
    net = Network(f"{os.getpid() % 10000}")
    etcd = None
    try:
        hosts = [net.add_host() for _ in range(max(sizes))]
        if binary:
            etcd = start_etcd(binary, net.gateway, root)
        ep = etcd.endpoint if etcd else ""
        for rep in range(ns.repeats):
            for n in sizes:
                for method in methods:
                    work = root / f"r{rep}-{n}-{method.replace(' ', '_')}"
                    wall, internal = rendezvous_once(method, hosts[:n], ep, work)
                    if wall is None:
                        failures.append(f"rendezvous, {method}, {n} nodes, repeat {rep + 1}")
                    else:
                        rdzv.setdefault((method, n), []).append(wall)
                    if internal is not None:
                        inner.setdefault((method, n), []).append(internal)
                    print(
                        f"[{rep + 1}/{ns.repeats}] rendezvous {method} n={n}: {fmt(wall)}",
                        flush=True,
                    )
            for method in methods:
                work = root / f"loss{rep}-{method.replace(' ', '_')}"
                took = node_loss_once(method, hosts[0], hosts[1], ep, work)
                if took is None:
                    failures.append(f"node loss, {method}, repeat {rep + 1}")
                else:
                    loss.setdefault(method, []).append(took)
                print(f"[{rep + 1}/{ns.repeats}] node loss {method}: {fmt(took)}", flush=True)
    finally:
        if etcd is not None:
            stop_etcd(etcd)
        net.close()
        if ns.keep:
            print(f"work folders kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    ref = "torchrun c10d"
    rows = []
    for n in sizes:
        for method in methods:
            wall = med(rdzv.get((method, n), []))
            rows.append(
                [
                    str(n),
                    method,
                    fmt(wall),
                    ratio(wall, med(rdzv.get((ref, n), []))) if method != ref else "1.00x",
                    fmt(med(inner.get((method, n), []))),
                    f"{len(rdzv.get((method, n), []))}/{ns.repeats}",
                ]
            )
    show(
        f"Rendezvous: all launchers start at once → every worker started (median of {ns.repeats})",
        [
            "nodes",
            "launcher",
            "all start → every worker ready",
            "vs torchrun",
            "last node in → round known everywhere",
            "ok",
        ],
        rows,
        ns.markdown,
    )
    rows = []
    for method in methods:
        took = med(loss.get(method, []))
        rows.append(
            [
                method,
                fmt(took),
                ratio(took, med(loss.get(ref, []))) if method != ref else "1.00x",
                f"{len(loss.get(method, []))}/{ns.repeats}",
            ]
        )
    show(
        "Node loss: a host of a 2-node DDP job (--nnodes 1:2) dies → survivor's first new step",
        ["launcher", "host lost → resumed step", "vs torchrun", "ok"],
        rows,
        ns.markdown,
    )
    for f in failures:
        print(f"- failed: {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
