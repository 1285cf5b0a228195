"""The README's main job after a crash: fault -> first resumed step, and fault -> back
at full speed (issue 24 item 1), under torchrun, ``stalwart run --no-warm`` and
``stalwart run``.

The job is examples/train_ddp.py as the README runs it (2 ranks on gloo, rank 1 crashes
at step ``--fault-at``; a checkpoint every ``--ckpt-every`` steps), rank 0 writing one
record per step.  torchrun runs with its working configuration here
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, see /work/shared/FINDINGS.md); the fault comes
through STALWART_INJECT, which the example reads under any launcher.  From rank 0's
records:

* the fault: the end of the last step of the first attempt;
* first resumed step: -> the end of the first step of the next attempt;
* back at full speed: -> from when every window of one checkpoint interval runs at
  >= 90 % of the first attempt's step rate (``stalwart.reporting.goodput.full_speed_at``,
  the same rule as the closing block's);
* second save stall: the restarted attempt's second save, as the loop saw it (stalwart's
  events only: the checkpointer reports each save's stall there).

    python bench/bench_warmwriter.py [--repeats 3] [--launchers torchrun,cold,warm]
        [--steps 400] [--ckpt-every 20] [--fault-at 130] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, run_job, show, spread

from stalwart.reporting.goodput import full_speed_at

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def command(launcher: str, work: Path, args: argparse.Namespace) -> list[str]:
    job = [
        str(EXAMPLE),
        "--steps",
        str(args.steps),
        "--ckpt-every",
        str(args.ckpt_every),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--progress",
        str(work / "p.jsonl"),
        "--quiet",
    ]
    if launcher == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "3",
            *job,
        ]
    cold = ["--no-warm"] if launcher == "cold" else []
    return [
        sys.executable,
        "-m",
        "stalwart.cli",
        "run",
        *cold,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--log-dir",
        str(work / "runs"),
        *job,
    ]


def second_save_stall(work: Path) -> float | None:
    runs = sorted((work / "runs").glob("*/events.jsonl"))
    if not runs:
        return None
    evs = [json.loads(x) for x in runs[-1].read_text().splitlines() if x.strip()]
    stalls = [
        float(e["stall_s"])
        for e in sorted(evs, key=lambda e: float(e["time"]))
        if e.get("event") == "checkpoint_commit" and e.get("attempt") == 1 and "stall_s" in e
    ]
    return stalls[1] if len(stalls) > 1 else None


def one(launcher: str, args: argparse.Namespace) -> dict[str, float | None]:
    with tempfile.TemporaryDirectory(prefix="bench-ww-") as tmp:
        work = Path(tmp)
        env = {"STALWART_INJECT": f"crash:rank=1,step={args.fault_at}", "OMP_NUM_THREADS": "1"}
        if launcher == "torchrun":
            env.update(TORCHRUN_ENV)
        t0 = time.monotonic()
        code, recs = run_job(command(launcher, work, args), env, work, args.deadline)
        wall = time.monotonic() - t0
        before = sorted((float(r["time"]), int(r["step"])) for r in recs if r["attempt"] == 0)
        after = sorted((float(r["time"]), int(r["step"])) for r in recs if r["attempt"] == 1)
        out: dict[str, float | None] = {"wall": wall, "code": code}
        if before and after:
            fault = before[-1][0]
            out["first"] = after[0][0] - fault
            back = full_speed_at(before, after, args.ckpt_every)
            out["full"] = None if back is None else back - fault
        out["stall2"] = second_save_stall(work) if launcher != "torchrun" else None
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--launchers", default="torchrun,cold,warm")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--fault-at", type=int, default=130)
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds per run")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    launchers = args.launchers.split(",")
    results: dict[str, list[dict[str, float | None]]] = {name: [] for name in launchers}
    for _ in range(args.repeats):
        for name in launchers:  # interleaved: the machine's load hits each alike
            results[name].append(one(name, args))

    def col(name: str, key: str) -> list[float]:
        return [float(v) for r in results[name] if (v := r.get(key)) is not None]

    rows = [
        [
            name,
            f"{sum(1 for r in results[name] if r['code'] == 0)}/{len(results[name])}",
            spread(col(name, "first")),
            spread(col(name, "full")),
            spread(col(name, "stall2")),
            spread(col(name, "wall")),
        ]
        for name in launchers
    ]
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    show(
        f"README job, crash at step {args.fault_at} of {args.steps}, a save every "
        f"{args.ckpt_every} (min / median / max of {args.repeats}); {machine()}; {load}",
        [
            "launcher",
            "finished",
            "fault -> first step",
            "fault -> full speed",
            "2nd save stall",
            "wall",
        ],
        rows,
        args.markdown,
    )


if __name__ == "__main__":
    main()
