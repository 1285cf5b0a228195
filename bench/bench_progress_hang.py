"""Hang -> resumed with NO timeout configured, on a program that never imports stalwart.

The job is ``bench/plain_ddp_job.py`` (2 ranks, DDP on gloo, Adam, a checkpoint every 10
steps, no ``__main__`` guard, no stalwart import). Rank 1 hangs in the program's own code
(``sleep``: before the step's collective; ``stop``: SIGSTOP to itself):

* first attempt: at step 60 of attempt 0 (the rhythm learned in this attempt);
* after a restart: attempt 0 crashes at step 30 (``--inject crash``, which works on the
  unmodified program), attempt 1 hangs at step 60 (the rhythm learned before the crash);

Steps take about 25 ms (a 20 ms sleep stands for data loading).

under ``stalwart run`` with nothing configured, and under torchrun with nothing
configured (one run, capped: gloo's own timeout is 30 min). NVIDIA's ft_launcher needs
the program to send heartbeats through its client, which an unmodified program does
not; it is not run here (bench_hang.py times it with the client).

Times are from the last step rank 0 recorded before the hang to the hang_detected event
and to the first step of the next attempt (the job's own wall-clock stamps).

    python bench/bench_progress_hang.py [--repeats 3] [--idle-cap 120] [--markdown]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, show, spread

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "bench" / "plain_ddp_job.py"
STALWART = [sys.executable, "-m", "stalwart.cli", "run"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
HANG_AT, STEPS, CRASH_AT, STEP_SLEEP = 60, 70, 30, "0.02"


def env_for(work: Path, fault: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("STALWART_", "TORCHELASTIC_", "PET_"))
    }
    env.update(PJ_WORK=str(work), PJ_FAULT=fault, PJ_STEPS=str(STEPS), PJ_SLEEP=STEP_SLEEP)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # torchrun's restarts work (FINDINGS)
    return env


def once(launcher: list[str], kind: str, later: bool, cap: float) -> dict[str, float | str]:
    with tempfile.TemporaryDirectory(prefix="bench_progress_hang_") as d:
        work = Path(d)
        attempt = 1 if later else 0
        flags = ["--nproc-per-node", "2", "--max-restarts", "2"]
        if launcher is STALWART:
            flags += ["--log-dir", str(work / "logs")]
            if later:
                flags += ["--inject", f"crash:rank=1,step={CRASH_AT}"]
        cmd = [*launcher, *flags, str(JOB)]
        proc = subprocess.Popen(
            cmd,
            env=env_for(work, f"{kind}:1:{HANG_AT}:{attempt}"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=work,
        )
        try:
            code: int | None = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            code = None
            # The launcher and every process it started, each by its pid.
            victims = [*psutil.Process(proc.pid).children(recursive=True)]
            proc.kill()
            for child in victims:
                with contextlib.suppress(psutil.Error):
                    child.kill()
            proc.wait()
        p = work / "p.jsonl"
        recs = [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []
        last = [r for r in recs if r["attempt"] == attempt and r["step"] == HANG_AT]
        after = [r for r in recs if r["attempt"] == attempt + 1 and r["event"] == "step"]
        out: dict[str, float | str] = {}
        if code is None:
            out["note"] = f"not detected in {cap:.0f} s"
        if not last:
            out["note"] = "no step before the hang"
            return out
        t_hang = float(last[0]["time"])
        evs = [
            json.loads(line)
            for f in (work / "logs").glob("*/events.jsonl")
            for line in f.read_text().splitlines()
        ]
        hangs = [e for e in evs if e["event"] == "hang_detected" and e.get("attempt") == attempt]
        if hangs:
            out["detected"] = min(float(e["detected_at"]) for e in hangs) - t_hang
            roots = [e["global_rank"] for e in hangs if e["waiting_on"] is None]
            out["blamed"] = ",".join(map(str, roots))
        if after:
            out["resumed"] = float(after[0]["time"]) - t_hang
            steps = [
                float(r["time"]) for r in recs if r["attempt"] == attempt and r["event"] == "step"
            ]
            gaps = sorted(b - a for a, b in itertools.pairwise(steps))
            if gaps:
                out["step"] = gaps[len(gaps) // 2]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--idle-cap", type=float, default=120.0)
    ap.add_argument("--skip-idle", action="store_true", help="leave out torchrun")
    ap.add_argument("--markdown", action="store_true")
    ns = ap.parse_args()
    load = os.getloadavg()
    rows = []
    for kind in ("sleep", "stop"):
        for later in (False, True):
            runs = [once(STALWART, kind, later, 120.0) for _ in range(ns.repeats)]
            det = [float(r["detected"]) for r in runs if "detected" in r]
            res = [float(r["resumed"]) for r in runs if "resumed" in r]
            step = [float(r["step"]) for r in runs if "step" in r]
            blamed = [str(r.get("blamed", "-")) for r in runs]
            notes = sorted({str(r["note"]) for r in runs if "note" in r})
            rows.append(
                [
                    "stalwart run (nothing configured)",
                    f"{kind}, {'after a restart' if later else 'first attempt'}",
                    spread(det),
                    spread(res),
                    spread(step, "s", 3),
                    f"rank {' '.join(blamed)}",
                    "; ".join(notes),
                ]
            )
            print(f"{kind} later={later}: {runs}", file=sys.stderr)
    if not ns.skip_idle:
        r = once(TORCHRUN, "sleep", False, ns.idle_cap)
        rows.append(
            [
                "torchrun (nothing configured)",
                "sleep, first attempt",
                "n/a",
                "n/a",
                "",
                "-",
                str(r.get("note", "")),
            ]
        )
    print(f"machine: {machine()}")
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    show(
        f"Rank 1 hangs at step {HANG_AT}, no timeout configured, program without stalwart "
        f"(min / median / max of {ns.repeats})",
        ["launcher", "case", "hang -> detected", "hang -> resumed", "step time", "blamed", "notes"],
        rows,
        ns.markdown,
    )


if __name__ == "__main__":
    main()
