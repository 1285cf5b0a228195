"""Framework benchmark: Lightning and HF Trainer jobs, fault -> first resumed step and
fault -> back at full speed.

(The launcher benchmark's job, examples/train_ddp.py, runs alongside with its own step
numbers, for the SIGKILL path against the crash path on a job without a framework.)

The jobs are tests/frameworks/lightning_job.py (Lightning 2.6 ``Trainer``, DDP on gloo,
``ModelCheckpoint`` + ``ckpt_path="last"``) and tests/frameworks/hf_job.py (transformers
``Trainer`` on a tiny GPT-2 from a config, ``resume_from_checkpoint``), 2 ranks, 100 steps,
a checkpoint every 10; rank 1 faults at step 35 of the first attempt, either by exiting
with code 1 ("crash") or by SIGKILL to itself.  The first 6 steps of the first attempt
last ``--pause`` s more (1 s by default), so the fault comes after about 6 s of
training, as real crashes come after the warm template has learned the framework's
imports, and the steps between run at the job's own rate; the last column of the
breakdown says in how many runs the restart was forked from such a template.  Each runs under torchrun with its working
configuration here (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), ``stalwart run --no-warm`` and
``stalwart run`` (warm, the default), interleaved.  Times come from rank 0's own records:

* fault -> first resumed step: from the end of the step the fault followed to the end
  of the first step of the next attempt;
* fault -> back at full speed: from the same moment to the start of the next attempt's
  first span of two checkpoint intervals at >= 90 % of the first attempt's unpaused step
  rate (``stalwart.reporting.goodput.full_speed_at``, the closing block's rule);
* for stalwart, where that time went, from events.jsonl and the records: detect (the
  faulty worker's exit -> teardown began), survivor (teardown began -> the last worker
  exited: the survivor's own SIGTERM handling), respawn (-> the new attempt's workers
  started), setup (-> the framework's train-start hook: imports, process group, model,
  checkpoint load), first step.

    python bench/bench_frameworks.py [--repeats 3] [--jobs lightning,hf,example]
        [--launchers torchrun,cold,warm] [--pause 1.0] [--markdown]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import fmt, machine, med, ratio, run_job, show, spread

from stalwart.reporting.goodput import full_speed_at

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ROOT / "tests" / "frameworks"
STEPS, CKPT_EVERY, FAULT_AT = 100, 10, 35
PAUSE_S, PAUSE_STEPS = 1.0, 6


@dataclass(frozen=True)
class Job:
    name: str
    argv: tuple[str, ...]  # after the work folder's place, written {work}
    fault_at: int  # the step number given to the fault
    before: int  # rank 0's last recorded step before the fault
    last: int  # the job's last recorded step
    every: int  # steps between two checkpoints
    needs: str | None = None  # a module the job imports
    paused: int = 0  # the first attempt's steps slowed by --pause: not its own rate


JOBS = {
    "lightning": Job(
        "Lightning",
        (
            str(FRAMEWORKS / "lightning_job.py"),
            "{work}",
            str(STEPS),
            str(CKPT_EVERY),
            "{pause}",
            str(PAUSE_STEPS),
        ),
        FAULT_AT,
        FAULT_AT,
        STEPS,
        CKPT_EVERY,
        "lightning",
        PAUSE_STEPS,
    ),
    "hf": Job(
        "HF Trainer",
        (
            str(FRAMEWORKS / "hf_job.py"),
            "{work}",
            str(STEPS),
            str(CKPT_EVERY),
            "{pause}",
            str(PAUSE_STEPS),
        ),
        FAULT_AT,
        FAULT_AT,
        STEPS,
        CKPT_EVERY,
        "transformers",
        PAUSE_STEPS,
    ),
    # The launcher benchmark's job, for the SIGKILL path against the crash path (its
    # stalwart.inject.step comes before the step's work: the last recorded is one less).
    "example": Job(
        "examples/train_ddp.py",
        (
            str(ROOT / "examples" / "train_ddp.py"),
            *("--steps", "200", "--ckpt-every", "20", "--quiet"),
            *("--ckpt-dir", "{work}/ckpt", "--progress", "{work}/p.jsonl"),
        ),
        110,
        109,
        199,
        20,
    ),
}
FAULTS = {"crash": "exit:rank=1,step={at},code=1", "SIGKILL": "sigkill:rank=1,step={at}"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
STALWART = [sys.executable, "-m", "stalwart.cli", "run"]
PHASES = ("detect", "survivor", "respawn", "setup", "first step")


@dataclass
class Launcher:
    key: str
    name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    stalwart: bool = True


LAUNCHERS = [
    Launcher(
        "torchrun",
        "torchrun + TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        TORCHRUN,
        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        stalwart=False,
    ),
    Launcher("cold", "stalwart run --no-warm", [*STALWART, "--no-warm"]),
    Launcher("warm", "stalwart run (warm)", STALWART),
]
LAUNCHER_KEYS = [lc.key for lc in LAUNCHERS]


@dataclass
class Cell:
    resume: list[float] = field(default_factory=list)
    full: list[float] = field(default_factory=list)  # fault -> back at full speed
    phases: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    ok: int = 0
    runs: int = 0
    learned: int = 0  # runs whose restart was forked from a template with learned modules


def load() -> float:
    """The machine's 1-minute load average: other sessions share these cores."""
    return os.getloadavg()[0]


def read_events(work: Path) -> list[dict[str, Any]]:
    paths = list((work / "logs").glob("*/events.jsonl"))
    if len(paths) != 1:
        return []
    return [json.loads(x) for x in paths[0].read_text().splitlines() if x.strip()]


def learned_in_time(evs: list[dict[str, Any]]) -> bool:
    """Whether a template with learned modules was serving when the job restarted."""
    for e in evs:
        if e["event"] == "restart":
            return False
        if e["event"] == "template_ready" and e.get("learned"):
            return True
    return False


def phases(evs: list[dict[str, Any]], recs: list[dict[str, Any]]) -> dict[str, float | None] | None:
    """Where stalwart's fault -> resumed time went (see the module docstring); a job
    without a "start" record counts its setup up to the end of the first step."""
    # exited_at is None for a worker abandoned in uninterruptible sleep.
    exits = [
        e
        for e in evs
        if e["event"] == "worker_exit" and e["attempt"] == 0 and e["exited_at"] is not None
    ]
    stop = [e for e in evs if e["event"] == "workers_stopping" and e["attempt"] == 0]
    spawn = [e for e in evs if e["event"] == "worker_spawn" and e["attempt"] == 1]
    start = [r for r in recs if r.get("event") == "start" and r["attempt"] == 1]
    first = [r for r in recs if r.get("event", "step") == "step" and r["attempt"] == 1]
    faulty = [e["exited_at"] for e in exits if e["rank"] == 1]
    if not (exits and stop and spawn and first and faulty):
        return None
    last_exit = max(e["exited_at"] for e in exits)
    spawned = max(e["time"] for e in spawn)
    began = start[0]["time"] if start else None
    return {
        "detect": stop[0]["time"] - faulty[0],
        "survivor": last_exit - stop[0]["time"],
        "respawn": spawned - last_exit,
        "setup": (began if began is not None else first[0]["time"]) - spawned,
        "first step": first[0]["time"] - began if began is not None else None,
    }


def run_once(
    job: Job, fault: str, launcher: Launcher, cell: Cell, deadline: float, pause: float
) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_frameworks_") as d:
        work = Path(d)
        args = [
            *launcher.cmd,
            *("--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(work / "logs")),
            *(a.replace("{work}", str(work)).replace("{pause}", f"{pause:g}") for a in job.argv),
        ]
        env = {
            **launcher.env,
            "STALWART_INJECT": FAULTS[fault].format(at=job.fault_at),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(work / "hf_home"),
        }
        code, recs = run_job(args, env, work, deadline)
        cell.runs += 1
        steps = [r for r in recs if r.get("event", "step") == "step"]
        before = [r for r in steps if r["attempt"] == 0 and r["step"] == job.before]
        after = [r for r in steps if r["attempt"] == 1]
        if before and after:
            fault_t = before[-1]["time"]
            cell.resume.append(after[0]["time"] - fault_t)
            own = [
                (r["time"], r["step"])
                for r in steps
                if r["attempt"] == 0 and r["step"] > job.paused
            ]
            back = full_speed_at(own, [(r["time"], r["step"]) for r in after], job.every)
            if back is not None:
                cell.full.append(back - fault_t)
        if code == 0 and after and after[-1]["step"] == job.last:
            cell.ok += 1
        evs = read_events(work) if launcher.stalwart else []
        cell.learned += learned_in_time(evs)
        if launcher.stalwart and (split := phases(evs, recs)) is not None:
            for name, value in split.items():
                if value is not None:
                    cell.phases[name].append(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds per run")
    ap.add_argument(
        "--jobs", default=",".join(JOBS), help="comma-separated subset of " + ",".join(JOBS)
    )
    ap.add_argument(
        "--pause",
        type=float,
        default=PAUSE_S,
        help="seconds each step of the first attempt lasts (framework jobs): the fault "
        "comes after FAULT_AT x PAUSE s of training, once the warm template has learned "
        "the framework, as a real crash would",
    )
    ap.add_argument(
        "--launchers",
        default=",".join(LAUNCHER_KEYS),
        help="comma-separated subset of " + ",".join(LAUNCHER_KEYS),
    )
    ap.add_argument("--markdown", action="store_true")
    ns = ap.parse_args()
    chosen = [j for j in ns.jobs.split(",") if j]
    unknown = [j for j in chosen if j not in JOBS]
    if unknown or not chosen:
        ap.error(f"--jobs {ns.jobs!r}: expected names from {','.join(JOBS)}")
    missing = [n for j in chosen if (n := JOBS[j].needs) and importlib.util.find_spec(n) is None]
    if missing:
        ap.error(f"{', '.join(missing)} not installed: pip install -c constraints.txt -e '.[test]'")
    jobs = [JOBS[j] for j in chosen]
    keys = [k for k in ns.launchers.split(",") if k]
    if not keys or any(k not in LAUNCHER_KEYS for k in keys):
        ap.error(f"--launchers {ns.launchers!r}: expected names from {','.join(LAUNCHER_KEYS)}")
    launchers = [lc for lc in LAUNCHERS if lc.key in keys]
    ours = [lc for lc in launchers if lc.stalwart]
    cells: dict[tuple[str, str, str], Cell] = {
        (j.name, f, lc.name): Cell() for j in jobs for f in FAULTS for lc in launchers
    }
    loads = [load()]
    t0 = time.monotonic()
    for i in range(ns.repeats):
        # Interleaved, so drift on a shared machine hits every launcher alike.
        for job in jobs:
            for fault in FAULTS:
                for lc in launchers:
                    cell = cells[(job.name, fault, lc.name)]
                    run_once(job, fault, lc, cell, ns.deadline, ns.pause)
                    loads.append(load())
                    print(
                        f"[{i + 1}/{ns.repeats}] {job.name} {fault} {lc.name}: "
                        f"ok {cell.ok}/{cell.runs} ({time.monotonic() - t0:.0f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
    print(f"machine: {machine()}")
    print(f"load average (1 min) between runs: {min(loads):.1f} to {max(loads):.1f}")
    ref = LAUNCHERS[0]
    rows = []
    for job in jobs:
        for fault in FAULTS:
            anchor = med(cells[(job.name, fault, ref.name)].resume) if ref in launchers else None
            for lc in launchers:
                c = cells[(job.name, fault, lc.name)]
                first, full = med(c.resume), med(c.full)
                # A run whose resumed attempt never held the rate for two intervals has
                # no full-speed figure: the count says over how many runs it is taken.
                back = f"{spread(c.full)} ({len(c.full)}/{c.runs})"
                rows.append(
                    [job.name, fault, lc.name, f"{c.ok}/{c.runs}", spread(c.resume), back,
                     ratio(full, first), ratio(first, anchor)]
                )  # fmt: skip
    show(
        "Fault -> first resumed step and -> back at full speed: 2 ranks on gloo, rank 1 "
        "faults once (min / median / max)",
        [
            "job",
            "fault",
            "launcher",
            "finished",
            "first resumed step",
            "back at full speed",
            "full / first",
            "first vs torchrun",
        ],
        rows,
        ns.markdown,
    )
    rows = []
    for job in jobs:
        for fault in FAULTS:
            for lc in ours:
                c = cells[(job.name, fault, lc.name)]
                rows.append(
                    [job.name, fault, lc.name, *(fmt(med(c.phases[p])) for p in PHASES),
                     f"{c.learned}/{c.runs}"]
                )  # fmt: skip
    show(
        "Where stalwart's fault -> resumed time goes (medians)",
        ["job", "fault", "launcher", *PHASES, "learned template used"],
        rows,
        ns.markdown,
    )
    for job in jobs:
        for lc in ours:
            crash = med(cells[(job.name, "crash", lc.name)].resume)
            kill = med(cells[(job.name, "SIGKILL", lc.name)].resume)
            if crash is not None and kill is not None:
                print(f"- {job.name}, {lc.name}: SIGKILL path - crash path = {kill - crash:+.2f} s")


if __name__ == "__main__":
    main()
