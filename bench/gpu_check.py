"""stalwart's NCCL/CUDA paths, one mode each, for a lent GPU machine (bench/gpu_check.sh).

Each mode is a small job of its own, run under ``stalwart run`` by the shell script, and
prints one ``gpu_check <mode> ok {...}`` line with what it saw; any failure is a non-zero
exit. ``--device cpu`` runs the same logic on gloo so the script itself is checked on a
machine without a GPU (the CI machine), which is the only place it can be checked before
a device is lent.

Modes:
  env        what the machine has: torch, CUDA, NCCL, the GPU.
  ddp        DDP on NCCL with AsyncCheckpointer saving CUDA state (staging from device
             memory); the shell script injects a crash, and the second attempt must resume
             from the checkpoint onto the device and finish.
  dcp        FSDP2 (``fully_shard``) with CUDA DTensors through stalwart's DCP saver and
             its reusing stager (pinned host buffers), then ``load_newest``: the restored
             state must equal the saved one bit for bit.
  inprocess  ``stalwart.inprocess.Wrapper`` over an NCCL group: a fault in the first
             iteration aborts the communicators and the second iteration runs a
             collective on a fresh group.
  dcpbench   issue 23's figures on the device: an FSDP2 model + AdamW of --mib MiB of
             parameters (x3 with the moments) in CUDA memory, one rank under
             ``stalwart run --ckpt-ram``; per repeat, the stall and time to durable of
             dcp.async_save (default; with DCP's asynchronous stager from pinned memory)
             and stalwart's AsyncDcpSaver (reusing pinned buffers, writer subprocess), a
             plain fsync'd write of the same bytes, then restores into the CUDA state:
             dcp.load from disk (page cache dropped where allowed), plain
             dcp.load(storage_reader=DcpReader(...)) (from RAM) and load_newest, each
             checked bit for bit against the state saved. Prints medians.
  hang       2 ranks, no stalwart import, no timeout configured: rank 1 falls asleep in
             its own code before the step's all-reduce in attempt 0 while rank 0 waits
             in the all-reduce and a device synchronise (where NCCL makes the waiting
             CPU spin). NCCL needs a GPU per rank: with fewer than 2 GPUs both ranks
             share the one and all-reduce CUDA tensors over gloo. The shell script
             checks the hang was detected, rank 1 blamed, and attempt 1 finished.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["env", "ddp", "dcp", "dcpbench", "inprocess", "hang"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/gpu_check_ckpt"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--mib", type=int, default=512, help="dcpbench: parameter MiB")
    p.add_argument("--repeats", type=int, default=3, help="dcpbench: repeats")
    return p.parse_args()


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        if not torch.cuda.is_available():
            sys.exit("gpu_check: --device cuda but torch.cuda.is_available() is False")
        # Ranks share the GPUs round robin (the hang mode runs 2 ranks on 1 GPU).
        local = int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1)
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _report(mode: str, **seen: object) -> None:
    print(f"gpu_check {mode} ok {json.dumps(seen, default=str)}", flush=True)


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).to(device)


def mode_env(device: torch.device) -> None:
    seen: dict[str, object] = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        seen["gpu"] = torch.cuda.get_device_name(device)
        seen["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    shm = os.statvfs("/dev/shm")
    seen["dev_shm_free_gib"] = round(shm.f_bavail * shm.f_frsize / 2**30, 1)
    seen["cpus"] = os.cpu_count()
    _report("env", **seen)


def mode_ddp(device: torch.device, ckpt: Path, steps: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from stalwart import inject
    from stalwart.checkpoint import AsyncCheckpointer, load_latest

    dist.init_process_group(_backend(device))
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    start = 0
    found = load_latest(ckpt, rank=0)
    if found is not None:
        model.load_state_dict(found.state_dict["model"])
        opt.load_state_dict(found.state_dict["optim"])
        start = int(found.state_dict["step"])
    if attempt > 0 and found is None:
        sys.exit("gpu_check ddp: a restarted attempt found no checkpoint to resume from")
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    saver = AsyncCheckpointer(ckpt, keep_last=2, rank=0, world_size=1) if rank == 0 else None
    for step in range(start, steps):
        inject.step(step)
        x = torch.randn(32, 64, device=device, generator=None)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done = step + 1
        if saver is not None and done % 10 == 0:
            # CUDA tensors: the checkpointer stages them out of device memory.
            saver.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": done}, done)
    if saver is not None:
        saver.wait()
        saver.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    _report("ddp", attempt=attempt, resumed_from=start, steps=steps)
    del ddp
    dist.destroy_process_group()


def mode_dcp(device: torch.device, ckpt: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from stalwart.checkpoint.dcp import AsyncDcpSaver, load_newest

    dist.init_process_group(_backend(device))
    model = _model(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64, device=device)).sum().backward()
    opt.step()

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    saver = AsyncDcpSaver(ckpt)
    staged, done = saver.save(state, step=1)
    staged.result()
    done.result()
    saver.close()
    saved = {k: v.full_tensor().cpu().clone() for k, v in msd.items()}

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    msd2, osd2 = get_state_dict(model, opt)
    target = {"model": msd2, "optim": osd2}
    step = load_newest(target, ckpt)
    if step != 1:
        sys.exit(f"gpu_check dcp: load_newest returned step {step}, expected 1")
    bad = [
        k for k, v in target["model"].items() if not torch.equal(v.full_tensor().cpu(), saved[k])
    ]
    if bad:
        sys.exit(f"gpu_check dcp: restored tensors differ from the saved ones: {bad}")
    _report("dcp", tensors=len(saved), device=str(next(iter(msd.values())).device))
    dist.destroy_process_group()


def mode_dcpbench(device: torch.device, ckpt: Path, mib: int, repeats: int) -> None:
    import shutil
    import statistics
    import time

    import torch.distributed.checkpoint as dcp

    # bench/ is the script's folder, so its sibling is importable here and on the device.
    from bench_dcp import _drop_cache as drop_cache
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from stalwart.checkpoint import dcp as sdcp
    from stalwart.checkpoint import layout
    from stalwart.checkpoint.dcp_storage import DcpReader

    # dcp.async_save needs a CPU backend beside NCCL (torch asserts it), as torchtitan
    # sets up; the dcp mode keeps NCCL alone, as most FSDP2 examples do.
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    side = 4096
    layers = max(1, round(mib * 2**20 / (side * side * 4)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(side, side, bias=False) for _ in range(layers)]).to(device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, side, device=device)).sum().backward()
    optim.step()
    m, o = get_state_dict(model, optim)
    state = {"model": m, "optim": o}
    tensors = [*m.values(), *[v for s in o["state"].values() for v in s.values()]]
    locals_ = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    locals_ = [t for t in locals_ if isinstance(t, torch.Tensor) and t.dim() > 0]
    nbytes = sum(t.numel() * t.element_size() for t in locals_)
    reference = [t.detach().cpu().clone() for t in locals_]
    on = {str(t.device) for t in locals_}

    def same() -> bool:
        return all(torch.equal(a.cpu(), b) for a, b in zip(locals_, reference, strict=True))

    def spoil() -> None:
        with torch.no_grad():
            for t in locals_:
                t.fill_(-1.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    root = ckpt / "stalwart"
    saver = sdcp.AsyncDcpSaver(root, keep_last=2)
    if saver.shard_process is not None:
        saver.shard_process.wait_ready(timeout=300)
    cuda = device.type == "cuda"
    stager = DefaultStager(StagingOptions(cuda, False, True, cuda))
    rows: dict[str, list[tuple[float, float]]] = {}
    sources: list[str] = []
    fresh_stagers = 0

    def note(name: str, stall: float, durable: float) -> None:
        rows.setdefault(name, []).append((stall, durable))

    for rep in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=ckpt / f"default-{rep}")
        stall = time.perf_counter() - t0
        fut.result()
        note("dcp.async_save default", stall, time.perf_counter() - t0)

        if not getattr(getattr(stager, "_state_dict_stager", None), "_deepcopy_dispatch", 1):
            # torch 2.11's async_save closes the stager it was given after the upload
            # (2.13 keeps it): a closed one fails the next stage with KeyError(type).
            stager = DefaultStager(StagingOptions(cuda, False, True, cuda))
            fresh_stagers += 1
        t0 = time.perf_counter()
        resp = dcp.async_save(state, checkpoint_id=ckpt / f"astager-{rep}", async_stager=stager)
        stall = time.perf_counter() - t0
        resp.upload_completion.result()  # type: ignore[union-attr]
        note("dcp.async_save async stager (pinned)", stall, time.perf_counter() - t0)

        t0 = time.perf_counter()
        _staged, done = saver.save(state, rep + 1)
        stall = time.perf_counter() - t0
        done.result()
        note("stalwart AsyncDcpSaver", stall, time.perf_counter() - t0)

        t0 = time.perf_counter()
        with open(ckpt / "raw", "wb") as f:
            for t in locals_:
                f.write(memoryview(t.detach().contiguous().cpu().view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())
        took = time.perf_counter() - t0
        note("plain write + fsync", took, took)

        for name in ("dcp.load (disk)", "dcp.load + DcpReader (RAM)", "stalwart load_newest"):
            spoil()
            cache = drop_cache(ckpt)
            t0 = time.perf_counter()
            if name == "dcp.load (disk)":
                dcp.load(state, checkpoint_id=ckpt / f"default-{rep}")
            elif name == "stalwart load_newest":
                sdcp.load_newest(state, root)
            else:
                dcp.load(state, storage_reader=DcpReader(layout.step_dir(root, rep + 1)))
            if cuda:
                torch.cuda.synchronize(device)
            took = time.perf_counter() - t0
            if not same():
                sys.exit(f"gpu_check dcpbench: {name} restored a state unlike the saved one")
            note(name, took, took)
            sources.append(cache)
        for name in (f"default-{rep}", f"astager-{rep}"):
            shutil.rmtree(ckpt / name, ignore_errors=True)
    # AdamW's step counters are CPU scalars (their buffers are not pinned): count the
    # buffers of CUDA tensors, i.e. the ones with more than one element here.
    big = [b for b in saver.stager._buffers.values() if b.numel() > 1]
    pinned = f"{sum(b.is_pinned() for b in big)}/{len(big)}" if cuda else None
    saver.close()
    stager.close()
    med = {
        k: [round(statistics.median(x[i] for x in v), 4) for i in (0, 1)] for k, v in rows.items()
    }
    print(f"gpu_check dcpbench rows (median stall s, median durable-or-load s): {json.dumps(med)}")
    _report(
        "dcpbench",
        state_gib=round(nbytes / 2**30, 2),
        tensors_on=sorted(on),
        stalwart_buffers_pinned=pinned,
        cache=sorted(set(sources)),
        repeats=repeats,
        dcp_stagers_made_again=fresh_stagers,
    )
    dist.destroy_process_group()


def mode_inprocess(device: torch.device) -> None:
    from stalwart.inprocess import Call, Wrapper

    backend = _backend(device)
    seen: dict[str, object] = {}

    @Wrapper(soft_timeout=30.0, hard_timeout=60.0, max_iterations=3)
    def train(call: Call) -> float:
        dist.init_process_group(backend)
        t = torch.ones(4, device=device) * (call.iteration + 1)
        dist.all_reduce(t)
        if call.iteration == 0:
            raise RuntimeError("gpu_check: injected fault in iteration 0")
        seen["iteration"] = call.iteration
        seen["sum"] = float(t.sum())
        dist.destroy_process_group()
        return float(t.sum())

    result = train()
    if seen.get("iteration") != 1 or result is None:
        sys.exit(f"gpu_check inprocess: expected a second iteration, saw {seen}")
    _report("inprocess", **seen)


def mode_hang(device: torch.device, steps: int) -> None:
    import time

    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    backend = "nccl" if gpus >= 2 else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        if attempt == 0 and rank == 1 and step == steps * 2 // 3:
            while True:
                time.sleep(3600)
        loss = model(torch.randn(32, 64, device=device)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        opt.step()
        time.sleep(0.01)
    _report("hang", attempt=attempt, backend=backend, gpus=gpus, steps=steps)
    dist.destroy_process_group()


def main() -> None:
    args = _args()
    device = _device(args.device)
    if args.mode == "env":
        mode_env(device)
    elif args.mode == "ddp":
        mode_ddp(device, args.ckpt, args.steps)
    elif args.mode == "dcp":
        mode_dcp(device, args.ckpt)
    elif args.mode == "dcpbench":
        mode_dcpbench(device, args.ckpt, args.mib, args.repeats)
    elif args.mode == "hang":
        mode_hang(device, args.steps)
    else:
        mode_inprocess(device)


if __name__ == "__main__":
    main()
