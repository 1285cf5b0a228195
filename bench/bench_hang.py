"""Hang benchmark: a rank hangs at step 30 of a 2-rank DDP job; how soon is it detected
and training resumed?

* stalwart run --hb-timeout 2: the example heartbeats every step (shared memory);
* torchrun + TORCHELASTIC_ENABLE_FILE_TIMER=1: each step runs under a 2 s named-pipe timer
  (torch's own FileTimerServer; stalwart's client speaks its protocol);
* torchrun with nothing configured (one run, capped): gloo's default timeout is 30 min.

Detection comes from stalwart's ``hang_detected`` event; resumed is the first step of the
next attempt; both are measured from the end of the last step before the hang (the
workers' own timestamps).

    python bench/bench_hang.py [--repeats 3] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, run_job, show, spread

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
HANG_AT, STEPS, TIMEOUT = 30, 40, 2.0
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
STALWART = [sys.executable, "-m", "stalwart.cli", "run"]


@dataclass
class Variant:
    name: str
    cmd: list[str]
    script_args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    repeats: int | None = None
    detected: list[float] = field(default_factory=list)
    resumed: list[float] = field(default_factory=list)
    finished: int = 0
    runs: int = 0
    notes: set[str] = field(default_factory=set)


def run_once(v: Variant, work: Path, deadline: float) -> None:
    logs = work / "logs"
    cmd = [
        *v.cmd,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--log-dir",
        str(logs),
        str(EXAMPLE),
        "--steps",
        str(STEPS),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--progress",
        str(work / "p.jsonl"),
        "--quiet",
        *v.script_args,
    ]
    inject = {"STALWART_INJECT": f"hang:rank=1,step={HANG_AT}"}
    code, recs = run_job(cmd, {**v.env, **inject}, work, deadline)
    if code is None:
        v.notes.add(f"still hung after {deadline:.0f} s (killed)")
    v.runs += 1
    last = [r for r in recs if r["attempt"] == 0 and r["step"] == HANG_AT - 1]
    after = [r for r in recs if r["attempt"] == 1]
    if not last:
        return
    t_hang = last[0]["time"]
    for ev_file in logs.glob("*/events.jsonl"):
        for line in ev_file.read_text().splitlines():
            ev = json.loads(line)
            if ev["event"] == "hang_detected" and ev.get("attempt") == 0:
                v.detected.append(ev["detected_at"] - t_hang)
                break
    if after:
        v.resumed.append(after[0]["time"] - t_hang)
    if code == 0 and any(r["step"] == STEPS - 1 for r in after):
        v.finished += 1
    elif code not in (0, None):
        v.notes.add(f"launcher exit {code}, no resumed step" if not after else f"exit {code}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--idle-cap", type=float, default=60.0, help="cap for the unconfigured run")
    ap.add_argument("--markdown", action="store_true")
    ns = ap.parse_args()
    t = str(TIMEOUT)
    vs = [
        Variant("stalwart run --hb-timeout 2", [*STALWART, "--hb-timeout", t], ["--heartbeat"]),
        Variant(
            "torchrun + file timer 2 s",
            TORCHRUN,
            ["--step-timer", t],
            {"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        ),
        Variant(
            "torchrun, nothing configured",
            TORCHRUN,
            [],
            {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
            repeats=1,
        ),
    ]
    for i in range(ns.repeats):
        for v in vs:
            if v.repeats is not None and v.runs >= v.repeats:
                continue
            with tempfile.TemporaryDirectory(prefix="bench_hang_") as d:
                run_once(v, Path(d), ns.idle_cap if v.repeats == 1 else 90.0)
            print(
                f"[{i + 1}/{ns.repeats}] {v.name}: finished {v.finished}/{v.runs}", file=sys.stderr
            )
    print(f"machine: {machine()}")
    show(
        f"Hang at step {HANG_AT} on rank 1, timeout {TIMEOUT:g} s (min / median / max, from the last good step)",
        ["launcher", "job finished", "hang -> detected", "hang -> resumed step", "notes"],
        [
            [
                v.name,
                f"{v.finished}/{v.runs}",
                spread(v.detected),
                spread(v.resumed),
                "; ".join(sorted(v.notes)),
            ]
            for v in vs
        ],
        ns.markdown,
    )
    print(
        f"Goals: detection <= timeout + 0.2 s = {TIMEOUT + 0.2:.1f} s; resumed <= timeout + 1.5 s = {TIMEOUT + 1.5:.1f} s"
    )


if __name__ == "__main__":
    main()
