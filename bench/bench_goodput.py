"""Goodput accounting: its productive time against the workers' own step timestamps,
and the per-step cost of reporting progress.

    .venv/bin/python bench/bench_goodput.py [--steps 400] [--repeats 3]

Agreement: `stalwart run` of bench/goodput_job.py (2 ranks) without and with one
injected crash; the independent figure is the kept work from the workers' own per-step
timestamps (see `independent`).
Overhead: `stalwart.progress.report(step)` and `stalwart.inject.step(step)` with the
launcher's slot mapped, in a tight loop (median of repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

from stalwart.reporting.goodput import account  # noqa: E402
from stalwart.reporting.read import read_events  # noqa: E402


def independent(out: Path) -> float:
    """Kept work from the workers' own timestamps, all ranks together: each attempt from
    the first step any rank started to, for a failed attempt, the moment the first rank
    started the step the next attempt resumed from (work past it was redone), and for
    the last attempt the end of the last step any rank finished."""
    recs: dict[int, list[dict[str, float]]] = {}
    for f in out.glob("times_*_*.jsonl"):
        attempt = int(f.name.split("_")[1])
        recs.setdefault(attempt, []).extend(json.loads(x) for x in f.read_text().splitlines())
    attempts = sorted(recs)
    total = 0.0
    for i, a in enumerate(attempts):
        start = min(r["start"] for r in recs[a])
        if i + 1 < len(attempts):
            resume = min(r["step"] for r in recs[attempts[i + 1]])
            redo = [r["start"] for r in recs[a] if r["step"] == resume]
            end = min(redo) if redo else max(r["end"] for r in recs[a])
        else:
            end = max(r["end"] for r in recs[a])
        total += end - start
    return total


def one_run(steps: int, crash: bool) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory(prefix="bench_goodput_") as tmp:
        out = Path(tmp)
        cmd = [sys.executable, "-m", "stalwart.cli", "run", "--nproc-per-node", "2",
               "--max-restarts", "1", "--log-dir", str(out / "logs"), "--rdzv-id", "bench"]  # fmt: skip
        if crash:
            cmd += ["--inject", f"crash:rank=1,step={int(steps * 0.6)}"]
        cmd += [str(HERE / "goodput_job.py"), str(out), str(steps), str(max(steps // 10, 1))]
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "TORCHELASTIC_"))
        }
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"job failed: {proc.stderr[-2000:]}")
        b = account(list(read_events(out / "logs" / "bench" / "events.jsonl")))
        return b.seconds["productive"], independent(out), b.wall


def overhead(n: int = 1_000_000, repeats: int = 5) -> dict[str, float]:
    from stalwart import inject, progress

    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        board = progress.ProgressBoard(Path(tmp), 1)
        saved = {
            k: os.environ.get(k) for k in (progress.SHM_ENV, progress.SLOT_ENV, inject.ENV_VAR)
        }
        os.environ.update(board.worker_env(0))
        os.environ.pop(inject.ENV_VAR, None)
        progress.reset()
        inject.reset()
        try:
            for name, fn in (("progress.report", progress.report), ("inject.step", inject.step)):
                times = timeit.repeat(
                    lambda f=fn: [f(i) for i in range(n)], number=1, repeat=repeats
                )  # type: ignore[misc]
                loop = timeit.repeat(lambda: [i for i in range(n)], number=1, repeat=repeats)
                results[name] = (statistics.median(times) - statistics.median(loop)) / n * 1e9
            assert board.read()[0].step == n - 1
        finally:
            board.close()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            progress.reset()
            inject.reset()
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    ns = p.parse_args()
    print("## Goodput accounting\n")
    print(f"`bench/goodput_job.py`, 2 ranks, {ns.steps} steps, medians of {ns.repeats} runs.\n")
    print(
        "| run | productive (accounting) s | kept work (workers' timestamps) s | difference | wall s |"
    )
    print("|---|---|---|---|---|")
    for crash in (False, True):
        rows = [one_run(ns.steps, crash) for _ in range(ns.repeats)]
        acc = statistics.median(r[0] for r in rows)
        ind = statistics.median(r[1] for r in rows)
        diffs = [abs(r[0] - r[1]) / r[1] * 100 for r in rows]
        wall = statistics.median(r[2] for r in rows)
        name = "one crash (rank 1 at 60 %)" if crash else "no fault"
        print(
            f"| {name} | {acc:.2f} | {ind:.2f} | {statistics.median(diffs):.2f} % (max {max(diffs):.2f} %) | {wall:.1f} |"
        )
    print("\n| per-step call | ns per call (median) |\n|---|---|")
    for name, ns_call in overhead().items():
        print(f"| `{name}` with the slot mapped | {ns_call:.0f} |")
    print(f"\n_{time.strftime('%Y-%m-%d')}_")


if __name__ == "__main__":
    main()
