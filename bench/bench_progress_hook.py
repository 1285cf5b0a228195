"""Per-step cost of the automatic progress signal (``stalwart.autostep``).

Each run is a fresh interpreter set up as a worker of ``stalwart run`` would be (a
monitor segment and a progress board of the launcher's, the slot variables), so the hook
writes where it does in a real job. Measured three ways, each the median of --repeats:

* the hook alone: ``autostep._on_step`` called directly, per call;
* ``optimizer.step()`` of a 1-parameter SGD with the hook installed minus without it:
  the cost a training step sees, torch's own hook dispatch included;
* the anchor: the same difference for torch's FileTimerClient acquire+release, which is
  what torchrun offers for a per-step signal (FINDINGS: about 36 µs), is not run here;
  NVIDIA's ``send_heartbeat`` round trip (FINDINGS: 117 µs) neither: both are measured in
  bench_monitor.py. This benchmark checks the 1 µs goal.

    python bench/bench_progress_hook.py [--repeats 5] [--calls 200000] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import fmt, machine, med, show

CHILD = r"""
import json, os, sys, time
from pathlib import Path
folder = Path(sys.argv[1]); calls = int(sys.argv[2]); hooked = sys.argv[3] == "1"
from stalwart import progress
from stalwart.monitor import envvars, layout
mm = layout.create_segment(folder / "monitor.shm", 1)
board = progress.ProgressBoard(folder, 1)
os.environ.update(board.worker_env(0))
os.environ[envvars.SHM_FILE] = str(folder / "monitor.shm")
os.environ[envvars.SLOT] = "0"
from stalwart import autostep
if hooked:
    autostep.install()
import torch
p = torch.nn.Parameter(torch.zeros(1))
opt = torch.optim.SGD([p], lr=0.0)
p.grad = torch.zeros(1)
opt.step()
out = {}
if hooked:
    f = autostep._on_step
    t = time.perf_counter()
    for _ in range(calls):
        f(opt, (), {})
    out["hook_us"] = (time.perf_counter() - t) / calls * 1e6
    assert layout.read_slot(mm, 0).iteration > 0 and board.read()[0].step > 0
n = calls // 10
step = opt.step
t = time.perf_counter()
for _ in range(n):
    step()
out["step_us"] = (time.perf_counter() - t) / n * 1e6
print(json.dumps(out))
"""


def once(calls: int, hooked: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STALWART_")}
        out = subprocess.run(
            [sys.executable, "-c", CHILD, d, str(calls), "1" if hooked else "0"],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    load = os.getloadavg()
    hook, with_hook, without = [], [], []
    for _ in range(args.repeats):
        a = once(args.calls, True)
        b = once(args.calls, False)
        hook.append(a["hook_us"])
        with_hook.append(a["step_us"])
        without.append(b["step_us"])
    delta = [w - o for w, o in zip(with_hook, without, strict=True)]
    print(machine())
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    rows = [
        ["hook alone (per call)", fmt(med(hook), "µs", 3)],
        ["optimizer.step() with the hook", fmt(med(with_hook), "µs", 2)],
        ["optimizer.step() without it", fmt(med(without), "µs", 2)],
        ["added per step (median of differences)", fmt(med(delta), "µs", 3)],
    ]
    show(f"automatic progress signal, median of {args.repeats}", ["", "cost"], rows, args.markdown)


if __name__ == "__main__":
    main()
