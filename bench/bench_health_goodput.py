"""Goodput of a job with one bad node, with and without stalwart's node checks.

Three simulated hosts (network namespaces) run a small DDP job on gloo
(``health_goodput_job.py``, which never imports stalwart) as an elastic job with a spare
(``--nnodes 2:3``, c10d, ``--max-restarts 4``); in each scenario but ``healthy`` one
host is bad:

* ``healthy``: no bad host: the reference a job with a bad node is measured against;
* ``slow``: its launcher (and so its workers) sits in a cgroup held to 20 % of one CPU
  (``--throttle``);
* ``failing``: its worker exits 7 at step 5 of every attempt.

Each scenario runs under torchrun (the anchor: no checks, no quarantine), stalwart
without checks (``--quarantine-after off``) and stalwart with ``--node-health`` (and the
default quarantine, 3 of the last 5), side by side in every repeat.  Printed per
scenario and launcher: how often the job finished its steps, the wall time from the
start to the two good launchers' exit, and three ratios that answer different
questions:

* **goodput**: useful work per wall-clock second, in units of a healthy job's work:
  the steps the job completed (all of them when it finished, none when it did not: the
  job keeps no checkpoint) times a healthy run's time per step (the median over this
  bench run's ``healthy`` runs, from the workers' own stamps), over the wall time.  A
  job that finishes sooner has the higher goodput, whatever it ran on;
* **training share of wall**: the finished attempt's training time (workers' stamps)
  over the wall time: how much of the wall the job spent stepping, at whatever pace.
  A job slowed by a straggler spends *more* of its wall training, so this share rises
  as the job gets slower: it is not goodput in the sense above;
* **stalwart report productive share**: ``stalwart report --json``'s ``goodput`` for
  node 0's run, the same kind of share (productive time over node 0's launcher wall).

For the slow node with ``--node-health`` it also prints where the first round's close
waited for it: from node 0's and the slow node's events, the slow launcher's first record
(``launcher_start``: its own start-up at its CPU share is over), its check
(``health_checked``), its exclusion (``node_excluded`` on node 0) and node 0's
``rendezvous_done`` (the round sealed), in seconds after the bench started the launchers.
(A failing node is not kept out by its check: it fails at step 5 and is quarantined.)

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
SCENARIOS = ("healthy", "slow", "failing")
BAD = 2  # the index of the bad host


@dataclass
class Phases:
    """When (seconds after the launchers' start) the first round's close got past the
    bad node; None where the events do not say."""

    bad_started: float | None  # the bad node's launcher_start
    own_checked: float | None  # node 0's health_checked (its own check over)
    bad_checked: float | None  # the bad node's health_checked (its report final)
    excluded: float | None  # node 0's node_excluded for round 0
    sealed: float | None  # node 0's rendezvous_done for round 0
    bad_check_s: float | None  # the bad node's whole check (its ``seconds`` + link time)


@dataclass
class Run:
    finished: bool
    wall: float
    steps: int  # steps the job completed: all when it finished, else none is kept
    step_s: float | None  # time per step, the finished attempt's (workers' stamps)
    share: float  # the finished attempt's training time / wall (0 when unfinished)
    reported: float | None  # stalwart's productive / its wall on node 0
    attempts: int
    kept_out: int  # node_excluded + node_quarantined events on node 0
    load: float
    phases: Phases | None

    def goodput(self, healthy_step_s: float | None) -> float | None:
        """Useful work per wall second, in a healthy job's step time (None: no
        reference)."""
        if healthy_step_s is None or self.wall <= 0:
            return None
        return self.steps * healthy_step_s / self.wall


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
    started = time.time()  # the events' clock
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
    reported, kept_out, phases = None, 0, None
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
        if launcher.endswith("--node-health") and scenario == "slow":
            phases = round_phases(work, started)
    return Run(
        finished, wall, steps if finished else 0, kept / steps if finished else None,
        kept / wall, reported, attempts, kept_out, load, phases,
    )  # fmt: skip


def _events(path: Path | None) -> list[dict[str, Any]]:
    if path is None:
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and isinstance(ev.get("time"), int | float):
            out.append(ev)
    return out


def round_phases(work: Path, started: float) -> Phases:
    """Where round 0's close waited for the bad node, from node 0's and its events."""
    node0 = _events(next((work / "logs0").glob("*/events.jsonl"), None))
    bad = _events(next((work / f"logs{BAD}").glob("*/events.jsonl"), None))

    def first(evs: list[dict[str, Any]], kind: str, **match: object) -> dict[str, Any] | None:
        hits = [
            e for e in evs if e["event"] == kind and all(e.get(k) == v for k, v in match.items())
        ]
        return min(hits, key=lambda e: float(e["time"])) if hits else None

    def at(ev: dict[str, Any] | None) -> float | None:
        return None if ev is None else float(ev["time"]) - started

    checked = first(bad, "health_checked", attempt=0)
    check_s = None
    if checked is not None:
        check_s = float(checked.get("seconds") or 0) + float(checked.get("links_s") or 0)
    return Phases(
        bad_started=at(first(bad, "launcher_start")),
        own_checked=at(first(node0, "health_checked", attempt=0)),
        bad_checked=at(checked),
        excluded=at(first(node0, "node_excluded", attempt=0)),
        sealed=at(first(node0, "rendezvous_done", attempt=0)),
        bad_check_s=check_s,
    )


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


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
                              f"wall {run.wall:.1f} s step {fmt(run.step_s, 's', 4)} "
                              f"share {run.share:.2f} reported {fmt(run.reported, '', 2)} "
                              f"attempts {run.attempts} kept out {run.kept_out} "
                              f"load {run.load:.1f} {run.phases or ''}", flush=True)  # fmt: skip
    finally:
        net.close()
        if ns.keep:
            print(f"run folders kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    healthy = [x.step_s for la in launchers for x in runs.get(("healthy", la), [])]
    ref = med([s for s in healthy if s is not None])
    print(f"healthy step time (median of {len(healthy)} healthy runs' finished attempts): "
          f"{fmt(ref, 's', 4)}")  # fmt: skip
    rows = []
    for sc in scenarios:
        anchor = med([x.wall for x in runs.get((sc, "torchrun"), [])])
        for la in launchers:
            rs = runs[(sc, la)]
            wall = med([x.wall for x in rs])
            reported = [x.reported for x in rs if x.reported is not None]
            good = [g for x in rs if (g := x.goodput(ref)) is not None]
            rows.append([
                sc, la, f"{sum(x.finished for x in rs)}/{len(rs)}", fmt(wall),
                ratio(wall, anchor), pct(med(good)), pct(med([x.share for x in rs])),
                pct(med(reported)), " ".join(str(x.attempts) for x in rs),
                " ".join(str(x.kept_out) for x in rs), " ".join(f"{x.load:.1f}" for x in rs),
            ])  # fmt: skip
    show(
        f"one bad node of 3 (--nnodes 2:3), {ns.steps} steps: goodput with and without checks",
        ["bad node", "launcher", "finished", "median wall", "wall ÷ torchrun",
         "goodput (steps × healthy step ÷ wall)", "training share of wall (job's stamps)",
         "stalwart report productive share", "attempts per run", "kept out per run",
         "load (1 min) per run"],
        rows, ns.markdown,
    )  # fmt: skip
    waits = []
    for sc in scenarios:
        rs = [x.phases for x in runs.get((sc, "stalwart --node-health"), []) if x.phases]
        if not rs:
            continue

        def col(f: Callable[[Phases], float | None], rs: list[Phases] = rs) -> str:
            return fmt(med([v for p in rs if (v := f(p)) is not None]))

        waits.append([
            sc, str(len(rs)), col(lambda p: p.bad_started), col(lambda p: p.bad_check_s),
            col(lambda p: p.own_checked), col(lambda p: p.bad_checked),
            col(lambda p: p.excluded), col(lambda p: p.sealed),
            col(lambda p: None if p.sealed is None or p.own_checked is None
                else p.sealed - p.own_checked),
        ])  # fmt: skip
    if waits:
        show(
            "round 0 with --node-health: seconds after the launchers' start (medians)",
            ["bad node", "runs", "bad launcher's first record", "bad node's check took",
             "node 0 checked", "bad node checked", "excluded (node 0)", "round sealed",
             "sealed − node 0 checked"],
            waits, ns.markdown,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
