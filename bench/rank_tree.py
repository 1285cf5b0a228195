"""NVIDIA 0.4.1's ``rank_assignment.Tree`` against stalwart's, side by side: CPU time of
the first call (key exchange, tree, first seats) and of the call after 1,024 of 16,384
ranks were terminated, for the three flag settings of NVIDIA's own performance tests.

    .venv/bin/python bench/rank_tree.py --nvidia /path/to/nvidia-resiliency-ext@v0.4.1 [--repeats 5]

``--nvidia`` is a checkout of the tag (its ``src/`` is put on the path of a separate
interpreter; nothing of it is copied).  CPU time (``time.process_time``) rather than
wall time: the machine is shared, and the load is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

# Runs in a fresh interpreter per side; argv: side, checkout, repeats.
_PROBE = r"""
import json, random, sys, time, types
side, checkout, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
if side == "nvidia":
    import xml.etree.ElementTree as et
    sys.path.insert(0, checkout + "/src")
    # Only its GPU health checks import defusedxml, which is not installed here.
    sys.modules.setdefault("defusedxml", types.ModuleType("defusedxml"))
    sys.modules.setdefault("defusedxml.ElementTree", et)
    import nvidia_resiliency_ext.inprocess as inprocess
else:
    import stalwart.inprocess as inprocess
RA = inprocess.rank_assignment

class Store:
    def __init__(self, states, keys):
        self.states, self.keys = states, keys
    def send_state(self, state, rank): pass
    def get_states(self, ranks): return [self.states[r] for r in ranks]
    def send_key(self, key, rank): pass
    def get_keys(self, ranks): return [self.keys[r] for r in ranks]

world = 2 ** 14
flags = {"backfill": RA.LayerFlag.BACKFILL, "reserve": RA.LayerFlag.RESERVE,
         "reserve|backfill": RA.LayerFlag.RESERVE | RA.LayerFlag.BACKFILL}
out = []
for name, flag in flags.items():
    for rep in range(repeats):
        random.seed(rep)
        layers = [RA.Layer(flag=flag),
                  RA.Layer(min_ranks=32, max_ranks=64, key_or_fn=lambda s: s.rank // 64, flag=flag),
                  RA.Layer(min_ranks=8, max_ranks=8, key_or_fn=lambda s: s.rank // 8, flag=flag)]
        states = {r: inprocess.State(r, world) for r in range(world)}
        keys = {r: [l.key_or_fn(s) if callable(l.key_or_fn) else l.key_or_fn for l in layers]
                for r, s in states.items()}
        tree = RA.Tree(layers)
        ctx = RA.RankAssignmentCtx(states[0], Store(states, keys), set())
        c0 = time.process_time()
        ctx = tree(ctx)
        c1 = time.process_time()
        ctx.terminated_ranks = set(random.sample(range(world), 2 ** 10))
        try:
            tree(ctx)
        except RA.RankDiscarded:
            pass
        out.append({"flags": name, "first": c1 - c0, "fault": time.process_time() - c1})
print(json.dumps(out))
"""


def _run(side: str, checkout: Path, repeats: int) -> list[dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, side, str(checkout), str(repeats)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{side}: exit {done.returncode}: {done.stderr.strip()[-400:]}")
    rows: list[dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvidia", type=Path, required=True, help="checkout of v0.4.1")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"load before: {load}")
    sides = {side: _run(side, args.nvidia, args.repeats) for side in ("nvidia", "stalwart")}
    print("| flags | call | NVIDIA 0.4.1 (median s CPU) | stalwart | ratio |")
    print("|---|---|---|---|---|")
    for flags in ("backfill", "reserve", "reserve|backfill"):
        for call in ("first", "fault"):
            med = {
                side: statistics.median(float(str(r[call])) for r in rows if r["flags"] == flags)
                for side, rows in sides.items()
            }
            ratio = med["stalwart"] / med["nvidia"] if med["nvidia"] else float("nan")
            print(
                f"| {flags} | {call} | {med['nvidia']:.3f} | {med['stalwart']:.3f} | {ratio:.2f} |"
            )
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"load after: {load}")


if __name__ == "__main__":
    main()
