"""Hang -> resumed with NO timeout configured, on programs that never import stalwart;
and a long healthy run with slow phases that must never be killed.

Jobs (2 ranks on gloo, no ``__main__`` guard, no stalwart import; PJ_* knobs):

* ``plain``: ``bench/plain_ddp_job.py`` (DDP, Adam, checkpoint every 10 steps, ≈ 25 ms
  steps); rank 1 hangs at step 60, in attempt 0 (first attempt) or, after an injected
  crash at step 30 (``--inject crash``, which works on the unmodified program), in
  attempt 1 (the rhythm learned before the crash);
* ``lightning``, ``hf``: ``tests/reliability/progress_jobs/{lightning,hf}_plain.py`` (a
  Lightning ``Trainer``, a transformers ``Trainer`` with a tiny GPT-2 from a config);
  rank 1 hangs at step 60 of attempt 0.

Hang kinds: ``sleep`` (asleep in the program's own code), ``stop`` (SIGSTOP to itself).

Launchers: ``stalwart run`` with nothing configured (timed, ``--repeats``); torchrun with
nothing configured and NVIDIA's ``ft_launcher`` with its heartbeat timeouts on the
unmodified program (one capped run each, all at once before the timed runs: they only
show whether anything is detected within ``--idle-cap``); ``ft_launcher`` with the
heartbeats its docs ask a program to send (``bench/progressbench_nv_shim.py`` sends one
per optimizer step), timed like stalwart.

Times are from rank 0's record of the last step before the hang (the job's wall-clock
stamps) to the detection and to the first step of the next attempt. For stalwart the
path is split by its events: detected, hung rank exited, restart decided, workers
spawned, first resumed step.

``--healthy-minutes M`` runs ``bench/progressbench_healthy_job.py`` for M minutes
(variable, sleep-dominated steps; every 300 steps a 3-8 s evaluation pass or
checkpoint, alternating) under ``stalwart run`` with nothing configured and counts
kills (goal: none).

    python bench/bench_progress_hang.py [--repeats 2] [--jobs plain,lightning,hf]
        [--idle-cap 120] [--skip-idle] [--skip-ft] [--healthy-minutes 0] [--markdown]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, show, spread

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
STALWART = [PY, "-m", "stalwart.cli", "run"]
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone"]
FT_LAUNCHER = [PY, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher", "--standalone"]
# NVIDIA's knobs, as its docs describe them: a first heartbeat within the initial timeout,
# then one at least every rank timeout. 2 s: FINDINGS' figure; the initial one covers
# the start (imports, process group, framework set-up) under load.
FT_TIMEOUTS = ["--ft-initial-rank-heartbeat-timeout", "60", "--ft-rank-heartbeat-timeout", "2"]
NV_SHIM = ROOT / "bench" / "progressbench_nv_shim.py"
HEALTHY = ROOT / "bench" / "progressbench_healthy_job.py"
HANG_AT, STEPS, CRASH_AT = 60, 70, 30


@dataclass(frozen=True)
class Job:
    name: str
    script: Path
    env: dict[str, str]
    later: bool  # its fault can be put in attempt 1 (after an injected crash)


JOBS = {
    "plain": Job("plain DDP", ROOT / "bench" / "plain_ddp_job.py", {"PJ_SLEEP": "0.02"}, True),
    "lightning": Job(
        "Lightning Trainer",
        ROOT / "tests" / "reliability" / "progress_jobs" / "lightning_plain.py",
        {},
        False,
    ),
    "hf": Job(
        "HF Trainer",
        ROOT / "tests" / "reliability" / "progress_jobs" / "hf_plain.py",
        {},
        False,
    ),
}


def env_for(work: Path, fault: str, extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("STALWART_", "TORCHELASTIC_", "PET_"))
    }
    env.update(PJ_WORK=str(work), PJ_FAULT=fault, PJ_STEPS=str(STEPS), HF_HOME=str(work / "hf"))
    env.update(extra)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # torchrun's restarts work (FINDINGS)
    return env


def run_capped(cmd: list[str], env: dict[str, str], cwd: Path, cap: float) -> int | None:
    """The launcher's exit code, or None when it was still running after *cap* seconds
    (then it and every process it started are killed, each by its pid)."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd
    )
    try:
        return proc.wait(timeout=cap)
    except subprocess.TimeoutExpired:
        victims = [*psutil.Process(proc.pid).children(recursive=True)]
        proc.kill()
        for child in victims:
            with contextlib.suppress(psutil.Error):
                child.kill()
        proc.wait()
        return None


def records(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def stalwart_events(work: Path) -> list[dict[str, object]]:
    return [
        json.loads(line)
        for f in (work / "logs").glob("*/events.jsonl")
        for line in f.read_text().splitlines()
    ]


def once(
    launcher: str, job: Job, kind: str, later: bool, cap: float, keep: Path | None = None
) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="bench_progress_hang_") as d:
        work = Path(d)
        attempt = 1 if later else 0
        flags = ["--nproc-per-node", "2", "--max-restarts", "2"]
        script: list[str] = [str(job.script)]
        if launcher == "stalwart":
            cmd = [*STALWART, *flags, "--log-dir", str(work / "logs")]
            if later:
                cmd += ["--inject", f"crash:rank=1,step={CRASH_AT}"]
        elif launcher == "torchrun":
            cmd = [*TORCHRUN, *flags]
        else:
            cmd = [*FT_LAUNCHER, *flags, *FT_TIMEOUTS]
            if launcher == "ft+heartbeats":
                script = [str(NV_SHIM), str(job.script)]
        fault = f"{kind}:1:{HANG_AT}:{attempt}"
        code = run_capped([*cmd, *script], env_for(work, fault, job.env), work, cap)
        recs = records(work / "p.jsonl")
        out: dict[str, object] = {"code": code}
        if code is None:
            out["note"] = f"not detected in {cap:.0f} s"
        last = [r for r in recs if r["attempt"] == attempt and r.get("step") == HANG_AT]
        after = [r for r in recs if r["attempt"] == attempt + 1 and r["event"] == "step"]
        if not last:
            out["note"] = "no step before the hang"
            return out
        t_hang = float(str(last[0]["time"]))
        if after:
            out["resumed"] = float(str(after[0]["time"])) - t_hang
            out["finished"] = recs[-1].get("step") == STEPS
        steps = [
            float(str(r["time"])) for r in recs if r["attempt"] == attempt and r["event"] == "step"
        ]
        gaps = sorted(b - a for a, b in itertools.pairwise(steps))
        if gaps:
            out["step"] = gaps[len(gaps) // 2]
        if launcher == "stalwart":
            out.update(stages(stalwart_events(work), attempt, t_hang))
        return out


def stages(evs: list[dict[str, object]], attempt: int, t_hang: float) -> dict[str, object]:
    """Where hang -> resumed went, from stalwart's events (seconds since the last step)."""
    out: dict[str, object] = {}

    def at(e: dict[str, object], key: str = "time") -> float:
        return float(str(e.get(key) or e["time"]))

    hangs = [e for e in evs if e["event"] == "hang_detected" and e.get("attempt") == attempt]
    if not hangs:
        return out
    out["detected"] = min(at(e, "detected_at") for e in hangs) - t_hang
    roots = [e for e in hangs if e.get("waiting_on") is None]
    out["blamed"] = ",".join(str(e["global_rank"]) for e in roots)
    out["timeout"] = min(float(str(e["timeout"])) for e in hangs)
    exits = [
        at(e, "exited_at")
        for e in evs
        if e["event"] == "worker_exit" and e.get("attempt") == attempt
    ]
    restart = [at(e) for e in evs if e["event"] == "restart" and e.get("attempt") == attempt]
    spawn = [at(e) for e in evs if e["event"] == "worker_spawn" and e.get("attempt") == attempt + 1]
    if exits:
        out["exited"] = max(exits) - t_hang
    if restart:
        out["decided"] = restart[0] - t_hang
    if spawn:
        out["spawned"] = max(spawn) - t_hang
    return out


def idle_runs(jobs: list[str], cap: float, skip_ft: bool) -> list[list[str]]:
    """torchrun and ft_launcher on the unmodified programs, all at once (each is idle
    once hung): does anything end the hang within *cap*?"""
    launchers = ["torchrun"] + ([] if skip_ft else ["ft_launcher"])
    results: dict[tuple[str, str], dict[str, object]] = {}

    def one(launcher: str, name: str) -> None:
        results[(launcher, name)] = once(launcher, JOBS[name], "sleep", False, cap)

    threads = [
        threading.Thread(target=one, args=(launcher, name))
        for launcher in launchers
        for name in jobs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = []
    for (launcher, name), r in sorted(results.items()):
        label = (
            "torchrun (nothing configured)"
            if launcher == "torchrun"
            else "ft_launcher " + " ".join(FT_TIMEOUTS[2:]) + " (unmodified program)"
        )
        resumed = [float(str(r["resumed"]))] if "resumed" in r else []
        note = str(r.get("note", "")) or f"exit {r.get('code')}"
        rows.append([label, f"{JOBS[name].name}, sleep, first attempt", "n/a", spread(resumed),
                     "", "-", note])  # fmt: skip
    return rows


def timed_rows(
    launcher: str, jobs: list[str], kinds: list[str], repeats: int, cap: float
) -> tuple[list[list[str]], list[list[str]]]:
    rows, profile = [], []
    for name in jobs:
        job = JOBS[name]
        for kind in kinds:
            for later in (False, True) if job.later and launcher == "stalwart" else (False,):
                runs = [once(launcher, job, kind, later, cap) for _ in range(repeats)]
                print(f"{launcher} {name} {kind} later={later}: {runs}", file=sys.stderr)

                def col(key: str, runs: list[dict[str, object]] = runs) -> list[float]:
                    return [float(str(r[key])) for r in runs if key in r]

                case = f"{job.name}, {kind}, {'after a restart' if later else 'first attempt'}"
                notes = sorted({str(r["note"]) for r in runs if "note" in r})
                blamed = [str(r.get("blamed", "-")) for r in runs]
                label = (
                    "stalwart run (nothing configured)"
                    if launcher == "stalwart"
                    else "ft_launcher " + " ".join(FT_TIMEOUTS[2:]) + " + heartbeats"
                )
                done = sum(1 for r in runs if r.get("finished"))
                rows.append([label, case, spread(col("detected")), spread(col("resumed")),
                             spread(col("step"), "s", 3),
                             f"rank {' '.join(blamed)}" if launcher == "stalwart" else "-",
                             "; ".join([f"finished {done}/{len(runs)}", *notes])])  # fmt: skip
                if launcher == "stalwart":
                    cells = []
                    prev = [0.0] * len(runs)
                    for key in ("detected", "exited", "decided", "spawned", "resumed"):
                        deltas = [
                            float(str(r[key])) - p
                            for r, p in zip(runs, prev, strict=True)
                            if key in r
                        ]
                        prev = [float(str(r.get(key, p))) for r, p in zip(runs, prev, strict=True)]
                        cells.append(f"{statistics.median(deltas):.2f}" if deltas else "n/a")
                    timeouts = col("timeout")
                    cells.insert(0, f"{statistics.median(timeouts):.2f}" if timeouts else "n/a")
                    profile.append([case, *cells])
    return rows, profile


def healthy(minutes: float) -> None:
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_progress_healthy_") as d:
        work = Path(d)
        env = env_for(work, "none:0:0", {"PJ_SECONDS": str(minutes * 60)})
        cmd = [*STALWART, "--nproc-per-node", "2", "--max-restarts", "3",
               "--log-dir", str(work / "logs"), str(HEALTHY)]  # fmt: skip
        code = run_capped(cmd, env, work, minutes * 60 + 300)
        evs = stalwart_events(work)
        recs = records(work / "p.jsonl")
        kills = [e for e in evs if e["event"] in ("hang_detected", "restart")]
        learned = sorted(
            {f"{float(str(e['timeout'])):.2f}" for e in evs if e["event"] == "hang_detected"}
        )
        phases = [r for r in recs if r["event"] in ("eval", "checkpoint")]
        slowest = max((float(str(r["seconds"])) for r in phases), default=0.0)
        end = next((r for r in reversed(recs) if r["event"] == "end"), None)
        timeouts_file = next((work / "logs").glob("*/learned_timeouts.json"), None)
        learned_text = timeouts_file.read_text().strip() if timeouts_file else "none"
        load1 = os.getloadavg()
        print(f"machine: {machine()}")
        print(f"load average at start: {' '.join(f'{x:.2f}' for x in load0)}")
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in load1)}")
        print(f"learned_timeouts.json at the end: {learned_text[:400]}")
        for e in kills:
            print(f"kill: {json.dumps(e)[:600]}")
        show(
            f"Healthy job with slow phases, {minutes:g} min under stalwart run (nothing configured)",
            ["steps", "eval passes", "checkpoints", "slowest phase", "hang reports / restarts",
             "launcher exit"],
            [[str(end["step"]) if end else "n/a",
              str(sum(1 for r in phases if r["event"] == "eval")),
              str(sum(1 for r in phases if r["event"] == "checkpoint")),
              f"{slowest:.2f} s",
              f"{sum(1 for e in kills if e['event'] == 'hang_detected')} / "
              f"{sum(1 for e in kills if e['event'] == 'restart')}"
              + (f" (timeouts {', '.join(learned)} s)" if learned else ""),
              "still running (killed)" if code is None else str(code)]],
            markdown=True,
        )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--jobs", default="plain,lightning,hf")
    ap.add_argument("--kinds", default="sleep,stop")
    ap.add_argument("--idle-cap", type=float, default=120.0)
    ap.add_argument("--skip-idle", action="store_true", help="leave out the capped runs")
    ap.add_argument("--skip-ft", action="store_true", help="leave out NVIDIA's ft_launcher")
    ap.add_argument("--healthy-minutes", type=float, default=0.0)
    ap.add_argument("--markdown", action="store_true")
    ns = ap.parse_args()
    if ns.healthy_minutes > 0:
        healthy(ns.healthy_minutes)
        if ns.repeats == 0:
            return
    jobs = [j for j in ns.jobs.split(",") if j]
    kinds = [k for k in ns.kinds.split(",") if k]
    for j in jobs:
        if j not in JOBS:
            ap.error(f"--jobs: {j!r} is not one of {', '.join(JOBS)}")
    load = os.getloadavg()
    rows = [] if ns.skip_idle else idle_runs(jobs, ns.idle_cap, ns.skip_ft)
    load_timed = os.getloadavg()
    timed, profile = timed_rows("stalwart", jobs, kinds, ns.repeats, 120.0)
    rows += timed
    if not ns.skip_ft:
        rows += timed_rows("ft+heartbeats", jobs, ["sleep"], ns.repeats, 120.0)[0]
    print(f"machine: {machine()}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in load)}")
    print(f"load average at the timed runs' start: {' '.join(f'{x:.2f}' for x in load_timed)}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    show(
        f"Rank 1 hangs at step {HANG_AT}, no timeout configured, programs without stalwart "
        f"(min / median / max of {ns.repeats})",
        ["launcher", "case", "hang -> detected", "hang -> resumed", "step time", "blamed",
         "notes"],
        rows,
        ns.markdown,
    )  # fmt: skip
    show(
        "Where stalwart's hang -> resumed goes (medians, seconds; each stage from the previous)",
        ["case", "learned timeout", "hang -> detected", "-> hung ranks exited",
         "-> restart decided", "-> workers spawned", "-> first resumed step"],
        profile,
        ns.markdown,
    )  # fmt: skip


if __name__ == "__main__":
    main()
