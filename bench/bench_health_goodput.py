"""Goodput of a job with one bad node, with and without stalwart's node checks.

Three simulated hosts (network namespaces) run a small DDP job on gloo
(``health_goodput_job.py``, which never imports stalwart) as an elastic job with a spare
(``--nnodes 2:3``, c10d, ``--max-restarts 4``); one host is bad:

* ``slow``: its launcher (and so its workers) sits in a cgroup held to 20 % of one CPU
  (``--throttle``);
* ``failing``: its worker exits 7 at step 5 of every attempt.

Each scenario runs under torchrun (the anchor: no checks, no quarantine), stalwart
without checks (``--quarantine-after off``) and stalwart with ``--node-health`` (and the
default quarantine, 3 of the last 5), side by side in every repeat.  Printed per
scenario and launcher: how often the job finished its steps, the wall time from the
start to the two good launchers' exit, the goodput (the finished attempt's training
time, from the workers' own stamps, over that wall time), stalwart's own productive
share of node 0's run (``stalwart report --json``), and the attempts node 0 started.

Needs root.  ``python bench/bench_health_goodput.py [--repeats 3] [--steps 300] [--markdown]``
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))
from common import fmt, kill_leftovers, machine, med, ratio, show  # noqa: E402
from netns import JOB_SECRET, Host, Network, free_port, netns_usable, rdzv_args  # noqa: E402

from stalwart.reporting.report import run_record  # noqa: E402

JOB = HERE / "health_goodput_job.py"
# Integers: torchrun reads these as ints. A last call long enough for the slow node's
# launcher (itself throttled) to join the first round, so that it is in the job.
CONF = (
    "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=30,"
    "join_timeout=120,close_timeout=5"
)
LAUNCHERS = ("torchrun", "stalwart", "stalwart --node-health")
SCENARIOS = ("slow", "failing")
BAD = 2  # the index of the bad host


@dataclass
class Run:
    finished: bool
    wall: float
    goodput: float  # the finished attempt's training time / wall (0 when unfinished)
    reported: float | None  # stalwart's productive / its wall on node 0
    attempts: int
    kept_out: int  # node_excluded + node_quarantined events on node 0
    load: float


@contextmanager
def throttled(share: float) -> Iterator[Path]:
    """A cgroup holding whatever joins it to *share* of one CPU (cgroup v1 or v2)."""
    quota = str(int(100_000 * share))
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        group = v1 / f"swhgood{os.getpid()}"
        group.mkdir()
        (group / "cpu.cfs_quota_us").write_text(quota)
    else:
        group = Path("/sys/fs/cgroup") / f"swhgood{os.getpid()}"
        group.mkdir()
        (group / "cpu.max").write_text(f"{quota} 100000")
    try:
        yield group
    finally:
        for _ in range(50):
            pids = (group / "cgroup.procs").read_text().split()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        group.rmdir()


def _argv(launcher: str, h: Host, endpoint: str, rdzv_id: str, i: int, work: Path) -> list[str]:
    conf = CONF + (",is_host=1" if i == 0 else ",is_host=0")
    args = rdzv_args(
        backend="c10d", endpoint=endpoint, nnodes="2:3", run_id=rdzv_id, conf=conf,
        max_restarts=4,
    )  # fmt: skip
    if launcher == "torchrun":
        # torchrun advertises the host name, which resolves outside the namespace.
        head = [sys.executable, "-m", "torch.distributed.run", *args, "--local-addr", h.addr]
    else:
        head = [sys.executable, "-m", "stalwart.cli", "run", *args, "--shutdown-timeout", "3"]
        head += ["--node-health"] if launcher.endswith("--node-health") else []
        head += ["--quarantine-after", "off"] if launcher == "stalwart" else []
    return [*head, "--log-dir", str(work / f"logs{i}"), str(JOB), str(work), "STEPS"]


def one_run(
    scenario: str, launcher: str, hosts: list[Host], work: Path, steps: int, cgroup: Path | None
) -> Run:
    work.mkdir(parents=True)
    load = os.getloadavg()[0]
    endpoint = f"{hosts[0].addr}:{free_port()}"
    rdzv_id = f"hg{time.monotonic_ns()}"
    t0 = time.monotonic()
    procs = []
    for i, h in enumerate(hosts):
        argv = _argv(launcher, h, endpoint, rdzv_id, i, work)
        argv[-1] = str(steps)
        # One thread a worker: three workers' thread pools on 2 cores would hide the slow one.
        env = {
            "HEALTHBENCH_HOST": str(i),
            "STALWART_JOB_SECRET": JOB_SECRET,
            "OMP_NUM_THREADS": "1",
        }
        slow = scenario == "slow" and i == BAD and cgroup is not None
        if scenario == "failing" and i == BAD:
            env["HEALTHBENCH_BAD"] = "1"
        if slow:
            # ``ip netns exec`` hides the host's cgroups; a real host's launcher sees its
            # own, so this one runs in our mount namespace (network: the simulated host's).
            argv = ["nsenter", f"--mount=/proc/{os.getpid()}/ns/mnt", f"--wd={ROOT}", *argv]
        procs.append(h.spawn(*argv, log=work / f"n{i}.out", extra_env=env))
        if slow:
            assert cgroup is not None
            (cgroup / "cgroup.procs").write_text(str(procs[-1].pid))
    codes: list[int | None] = []
    deadline = t0 + 420
    for p in procs[:BAD]:
        try:
            codes.append(p.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    wall = time.monotonic() - t0
    try:
        procs[BAD].wait(max(1.0, min(30.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        pass
    for h in hosts:
        h.stop()
    kill_leftovers(work)
    done = [json.loads(f.read_text()) for f in work.glob("done_*.json")]
    finished = codes == [0, 0] and len(done) >= 2
    kept = max(d["end"] for d in done) - min(d["start"] for d in done) if finished else 0.0
    starts = work / "starts_0"
    attempts = len(starts.read_text().split()) if starts.exists() else 0
    reported, kept_out = None, 0
    if launcher != "torchrun":
        events = next((work / "logs0").glob("*/events.jsonl"), None)
        if events is not None:
            rec = run_record(events)
            b = rec["breakdown"]
            reported = b["goodput"]
            for line in events.read_text().splitlines():
                kept_out += (
                    '"event":"node_excluded"' in line or '"event":"node_quarantined"' in line
                )
    return Run(finished, wall, kept / wall, reported, attempts, kept_out, load)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--throttle", type=float, default=0.2, help="the slow node's CPU share")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--launchers", default=",".join(LAUNCHERS))
    ap.add_argument("--keep", action="store_true", help="keep the run folders (logs)")
    ap.add_argument("--markdown", action="store_true")
    ns = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    scenarios = [s for s in ns.scenarios.split(",") if s]
    launchers = [x for x in ns.launchers.split(",") if x]
    bad = sorted(set(scenarios) - set(SCENARIOS)) + sorted(set(launchers) - set(LAUNCHERS))
    if bad:
        sys.exit(f"bench_health_goodput: unknown {bad}; expected {SCENARIOS} and {LAUNCHERS}")
    why = netns_usable()
    if why:
        print(f"skipped: {why}")
        return 0
    print(machine())
    runs: dict[tuple[str, str], list[Run]] = {}
    base = Path(tempfile.mkdtemp(prefix="bench_hgood_"))
    net = Network(f"{os.getpid() % 10000}")
    try:
        hosts = [net.add_host() for _ in range(3)]
        with throttled(ns.throttle) as cgroup:
            for r in range(ns.repeats):
                for sc in scenarios:
                    for la in launchers:
                        tag = f"{sc}-{la.replace(' ', '').replace('-', '')}-{r}"
                        run = one_run(sc, la, hosts, base / tag, ns.steps, cgroup)
                        runs.setdefault((sc, la), []).append(run)
                        print(f"[{r + 1}/{ns.repeats}] {sc:8} {la:24} finished={run.finished} "
                              f"wall {run.wall:.1f} s goodput {run.goodput:.2f} "
                              f"reported {fmt(run.reported, '', 2)} attempts {run.attempts} "
                              f"kept out {run.kept_out} load {run.load:.1f}", flush=True)  # fmt: skip
    finally:
        net.close()
        if ns.keep:
            print(f"run folders kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    rows = []
    for sc in scenarios:
        anchor = med([x.wall for x in runs.get((sc, "torchrun"), [])])
        for la in launchers:
            rs = runs[(sc, la)]
            wall = med([x.wall for x in rs])
            reported = [x.reported for x in rs if x.reported is not None]
            rows.append([
                sc, la, f"{sum(x.finished for x in rs)}/{len(rs)}", fmt(wall),
                ratio(wall, anchor), f"{100 * (med([x.goodput for x in rs]) or 0):.0f}%",
                f"{100 * m:.0f}%" if (m := med(reported)) is not None else "n/a",
                " ".join(str(x.attempts) for x in rs), " ".join(str(x.kept_out) for x in rs),
                " ".join(f"{x.load:.1f}" for x in rs),
            ])  # fmt: skip
    show(
        f"one bad node of 3 (--nnodes 2:3), {ns.steps} steps: goodput with and without checks",
        ["bad node", "launcher", "finished", "median wall", "wall ÷ torchrun",
         "goodput (job's stamps)", "stalwart report goodput", "attempts per run",
         "kept out per run", "load (1 min) per run"],
        rows, ns.markdown,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
