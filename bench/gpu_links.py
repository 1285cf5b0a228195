"""The collective link check's process on this machine's devices (bench/gpu_check.sh).

With two or more GPUs (or on CPU: three processes on gloo) it runs one check process per
"node", each seeing one GPU (CUDA_VISIBLE_DEVICES), as the launcher would: the first
serves the store, the others are told where it is; every one must conclude, with NCCL
on GPUs, and blame nobody. With one GPU, NCCL cannot put two ranks on it: the check's
group maker is run alone (a one-rank NCCL group, a timed all-reduce on the GPU).

    python bench/gpu_links.py --device cuda|cpu
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
from datetime import timedelta

import msgspec

from stalwart.health.linkrun import Orders, Serving, _Groups
from stalwart.health.records import CollectiveLinks


def one_gpu() -> str:
    from torch._C._distributed_c10d import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=10))  # fmt: skip
    orders = Orders(rank=0, members=("n0",), host="127.0.0.1", prefix="gpu", key="00")
    groups = _Groups(
        orders, lambda: TCPStore("127.0.0.1", store.port, timeout=timedelta(seconds=10))
    )
    t = groups.time("gpu/one", 0, 1)
    assert groups.backend == "nccl", groups.backend
    assert t is not None, "a one-rank NCCL all-reduce failed"
    return f"one GPU: a one-rank {groups.backend} group timed {t * 1e3:.3g} ms"


def several(n: int, device: str) -> str:
    members = tuple(f"n{i}" for i in range(n))
    key = secrets.token_hex(32)
    procs = []
    for i in range(n):
        env = dict(os.environ)
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "stalwart.health.linkrun"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
        )

    def send(p: subprocess.Popen[bytes], rank: int, store: str) -> None:
        assert p.stdin is not None
        o = Orders(rank=rank, members=members, host="127.0.0.1", store=store,
                   prefix="gpu-links", key=key, device="auto" if device == "cuda" else "cpu")  # fmt: skip
        p.stdin.write(msgspec.json.encode(o) + b"\n")
        p.stdin.close()

    send(procs[0], 0, "")
    assert procs[0].stdout is not None
    served = msgspec.json.decode(procs[0].stdout.readline(), type=Serving)
    for i, p in enumerate(procs[1:], 1):
        send(p, i, served.store)
    results = []
    for p in procs:
        assert p.stdout is not None
        out = p.stdout.read()
        assert p.wait(timeout=120) == 0, p.returncode
        results.append(msgspec.json.decode(out.splitlines()[-1], type=CollectiveLinks))
    want = "nccl" if device == "cuda" else "gloo"
    for r in results:
        assert r.void == "" and r.nodes == () and r.links == (), r
        assert r.backend == want, r.backend
    return (
        f"{n} check processes on {want}: {results[0].stages} stage(s), "
        f"{max(r.seconds for r in results):.3g} s"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    dev = ap.parse_args().device
    if dev == "cuda":
        import torch

        n = torch.cuda.device_count()
        line = one_gpu() if n == 1 else several(min(n, 8), "cuda")
    else:
        line = several(3, "cpu")
    print(f"gpu_check health_links ok: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
