"""Sharded checkpoints: an FSDP2 model + AdamW on 2 gloo ranks, DCP vs stalwart's DCP path.

    .venv/bin/python bench/bench_dcp.py [--mib 384] [--repeats 3] [--markdown]

Measured in the same two processes, interleaved, per repeat:
  - stall (the save call returns) and durable (the step is on disk, fsync'd) for
    dcp.async_save with its default stager, with its asynchronous stager
    (DefaultStager, use_async_staging), and stalwart's AsyncDcpSaver (DcpWriter
    + ReusingStager: commit record, checksums, keep-last) with its shards written by
    the writer subprocess (default) and by DCP's thread in the rank;
  - a plain write of the same bytes with fsync (the disk's limit);
  - restore: dcp.load vs stalwart's load_newest (which also verifies every
    checksum), both after dropping the files from the page cache.
--mib is the parameter size; AdamW's two moments triple it (384 -> 1.1 GiB in all).
Each rank prints JSON lines; rank 0's parent prints medians and ratios with `uptime`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# "stalwart": shards written by the writer subprocess from shared memory (the default);
# "stalwart (in-rank writes)": by DCP's thread in the rank, as before.
SAVES = ("dcp default", "dcp async stager", "stalwart", "stalwart (in-rank writes)", "plain write")
ROOT = HERE.parent


def _drop_cache(folder: Path) -> str:
    """Evict a folder's files from the page cache (the whole cache when allowed)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "drop_caches"
    except OSError:
        for p in folder.rglob("*"):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "fadvise"


def rank_main(ns: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from stalwart.checkpoint import dcp as sdcp
    from stalwart.checkpoint.process_args import WriterProcessConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    side = 2048
    layers = max(1, round(ns.mib * 2**20 / (side * side * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, side)).sum().backward()
    optim.step()
    m, o = get_state_dict(model, optim)
    state = {"model": m, "optim": o}
    local = sum(
        t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else 0
        for t in [*m.values(), *[v for s in o["state"].values() for v in s.values()]]
    )
    total = torch.tensor([local])
    dist.all_reduce(total)
    work = Path(ns.work)
    ckpt_group = dist.new_group(backend="gloo")
    saver = sdcp.AsyncDcpSaver(
        work / "stalwart",
        keep_last=2,
        process_group=ckpt_group,
        # A loaded host can take over a minute to start an interpreter that imports torch.
        writer_config=WriterProcessConfig(init_timeout_s=600.0),
    )
    # The same saver with DCP writing the shards on its own thread in the rank (the
    # path before the writer subprocess), for the before/after rows.
    thread_saver = sdcp.AsyncDcpSaver(
        work / "stalwart-thread", keep_last=2, process_group=ckpt_group, subprocess=False
    )
    async_stager = DefaultStager(StagingOptions(False, False, True, False))
    if saver.shard_process is not None:
        # A save before the writer answered writes in the rank: time the subprocess.
        saver.shard_process.wait_ready(timeout=600)

    def emit(**rec: object) -> None:
        if rank == 0:
            print(json.dumps(rec), flush=True)

    emit(kind="size", total_bytes=int(total.item()), layers=layers)
    for rep in range(ns.repeats):
        for method in SAVES:
            dist.barrier()
            folder = work / f"plain-{rep}" if method != "stalwart" else None
            t0 = time.perf_counter()
            if method == "dcp default":
                fut = dcp.async_save(state, checkpoint_id=folder, process_group=ckpt_group)
                stall = time.perf_counter() - t0
                fut.result()
            elif method == "dcp async stager":
                resp = dcp.async_save(
                    state,
                    checkpoint_id=work / f"astager-{rep}",
                    process_group=ckpt_group,
                    async_stager=async_stager,
                )
                stall = time.perf_counter() - t0
                resp.upload_completion.result()  # type: ignore[union-attr]
            elif method.startswith("stalwart"):
                chosen = saver if method == "stalwart" else thread_saver
                _staged, done = chosen.save(state, rep + 1)
                stall = time.perf_counter() - t0
                done.result()
            else:
                out = work / f"raw-{rep}-{rank}"
                with open(out, "wb") as f:
                    for t in [*m.values(), *[v for s in o["state"].values() for v in s.values()]]:
                        if hasattr(t, "to_local"):
                            f.write(memoryview(t.to_local().contiguous().view(torch.uint8).numpy()))
                    f.flush()
                    os.fsync(f.fileno())
                stall = time.perf_counter() - t0
            durable = time.perf_counter() - t0
            dist.barrier()
            emit(kind="save", method=method, rep=rep, stall=stall, durable=durable)
        # Restore: both read from a cold page cache.
        for method in ("dcp.load", "stalwart load_newest"):
            dist.barrier()
            if rank == 0:
                how = _drop_cache(work)
            dist.barrier()
            t0 = time.perf_counter()
            if method == "dcp.load":
                dcp.load(state, checkpoint_id=work / f"plain-{rep}", process_group=ckpt_group)
            else:
                step = sdcp.load_newest(state, work / "stalwart", process_group=ckpt_group)
                assert step == rep + 1, step
            took = time.perf_counter() - t0
            dist.barrier()
            emit(kind="load", method=method, rep=rep, took=took, cache=how if rank == 0 else "")
        if rank == 0:
            for name in (f"plain-{rep}", f"astager-{rep}"):
                shutil.rmtree(work / name, ignore_errors=True)
        for p in work.glob(f"raw-{rep}-*"):
            p.unlink(missing_ok=True)
    saver.close()
    thread_saver.close()
    async_stager.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=384, help="parameter MiB (x3 with AdamW)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.mib < 1 or ns.repeats < 1:
        print(f"bench_dcp: --mib {ns.mib} / --repeats {ns.repeats}: expected >= 1", file=sys.stderr)
        return 2
    if ns.rank:
        rank_main(ns)
        return 0
    load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-dcp-"))
    port = 29500 + os.getpid() % 1000
    procs = []
    try:
        for rank in range(2):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PYTHONWARNINGS": "ignore",
            }
            args = [sys.executable, __file__, "--rank", "--work", str(work)]
            args += ["--mib", str(ns.mib), "--repeats", str(ns.repeats)]
            procs.append(
                subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
            )
        out, _ = procs[0].communicate()
        for p in procs[1:]:
            p.wait()
        if any(p.returncode for p in procs):
            print(f"bench_dcp: a rank failed: {[p.returncode for p in procs]}", file=sys.stderr)
            return 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
    load_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    recs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    report(recs, ns, load_before, load_after)
    return 0


def report(recs: list[dict], ns: argparse.Namespace, before: str, after: str) -> None:
    size = next(r for r in recs if r["kind"] == "size")
    gib = size["total_bytes"] / 2**30
    med = statistics.median
    print(
        f"### DCP on FSDP2: 2 ranks, gloo, {gib:.2f} GiB of state (model + AdamW), "
        f"{ns.repeats} repeats, medians\n"
    )
    print(f"- load before: `{before}`")
    print(f"- load after: `{after}`\n")
    saves = [r for r in recs if r["kind"] == "save"]
    plain = med([r["durable"] for r in saves if r["method"] == "plain write"])
    astall = med([r["stall"] for r in saves if r["method"] == "dcp async stager"])
    print("| save | stall s | durable s | durable ÷ plain write | stall ÷ DCP async stager |")
    print("|---|---|---|---|---|")
    for method in SAVES:
        rows = [r for r in saves if r["method"] == method]
        stall, durable = med([r["stall"] for r in rows]), med([r["durable"] for r in rows])
        print(
            f"| {method} | {stall:.3f} | {durable:.3f} | {durable / plain:.2f} | "
            f"{stall / astall if astall else float('nan'):.2f} |"
        )
    loads = [r for r in recs if r["kind"] == "load"]
    base = med([r["took"] for r in loads if r["method"] == "dcp.load"])
    cache = next((r["cache"] for r in loads if r["cache"]), "")
    print(f"\n| restore (page cache dropped: {cache}) | s | ÷ dcp.load |")
    print("|---|---|---|")
    for method in ("dcp.load", "stalwart load_newest"):
        took = med([r["took"] for r in loads if r["method"] == method])
        print(f"| {method} | {took:.3f} | {took / base:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
