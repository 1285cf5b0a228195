"""A stock node check for GPU nodes: ``--node-health-check "python -m stalwart.health.gpu"``.

Each visible GPU multiplies matrices for a short while; a GPU far slower than the
median of the node's other GPUs (a falling clock, a throttled or degraded device), one
that fails to run, or one with too little free memory fails the check, with the reason
on the first line of the output as the launcher reads it (``{"reason": ...}``). With
``--device cpu`` the same logic runs on the CPU (for tests on machines without a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence

#: A device below this fraction of its node-mates' median pace is slow.
SLOW = 0.5


def slow_devices(rates: Sequence[float], slow: float = SLOW) -> list[tuple[int, float, float]]:
    """(index, rate, the others' median) of each device far slower than the others."""
    out = []
    for i, r in enumerate(rates):
        others = [x for j, x in enumerate(rates) if j != i]
        if not others:
            continue
        ref = statistics.median(others)
        if ref > 0 and r < slow * ref:
            out.append((i, r, ref))
    return out


def _pace(device: str, seconds: float) -> float:
    """Tera-operations per second of square matrix products on *device*."""
    import torch

    n = 4096 if device.startswith("cuda") else 256
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    cuda = device.startswith("cuda")
    (a @ b).sum().item()  # warm up (kernel selection, clocks)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            a @ b
        if cuda:
            torch.cuda.synchronize(device)
        count += 8
    return 2 * n**3 * count / (time.perf_counter() - t0) / 1e12


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seconds", type=float, default=0.5, help="per device")
    ap.add_argument("--min-free", type=float, default=1.0, help="GiB free on each GPU")
    ns = ap.parse_args(argv)
    import torch

    if ns.device == "cpu":
        devices = ["cpu", "cpu"]  # two "devices" to compare, as a node's GPUs are
    elif not torch.cuda.is_available():
        print(json.dumps({"reason": "no CUDA device visible (torch.cuda.is_available() is False)"}))
        return 1
    else:
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    problems, rates = [], []
    for i, dev in enumerate(devices):
        try:
            if dev.startswith("cuda"):
                free, _ = torch.cuda.mem_get_info(i)
                if free < ns.min_free * 2**30:
                    problems.append(
                        f"GPU {i}: {free / 2**30:.1f} GiB free, expected {ns.min_free:g}"
                    )
            rates.append(_pace(dev, ns.seconds))
        except Exception as err:  # a device that cannot run is what this check is for
            problems.append(f"{dev}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            rates.append(0.0)
    for i, r, ref in slow_devices(rates):
        problems.append(f"{devices[i]}: {r:.1f} TOPS, {r / ref:.0%} of the other devices' median")
    if problems:
        print(json.dumps({"reason": "; ".join(problems)}))
        return 1
    print(json.dumps({"devices": devices, "tops": [round(r, 4) for r in rates]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
