"""An FSDP2 job for bench_dcp.py's restore and crash sections (no ``__main__`` guard,
like most training scripts).

    dcp_crash_job.py MODE OUT CKPT MIB ARG

``--mib`` of ``Linear(2048, 2048)`` parameters, fully sharded, with AdamW (three times
the bytes in all), 2 ranks on gloo.

MODE ``plain`` (under torchrun; never imports stalwart) or ``stalwart`` (under
``stalwart run --ckpt-ram``): train; at step ARG save a checkpoint (plain ``dcp.save``,
or stalwart's ``dcp.save`` with its RAM copy) and rank 1 SIGKILLs itself right after
it; the restarted job loads the newest step (plain: the newest folder with DCP's
metadata; stalwart: ``load_newest``) and trains two more steps. Rank 0 appends a line
per event to ``OUT/events.jsonl`` (``crash``, ``restored``, ``step``) with the wall time;
every rank appends one per stage to ``OUT/stages.jsonl`` (its process made, the script's
first line, imports, process group, model, restore, each step's forward, backward and
optimizer step) with the wall time and its CPU seconds so far, for the bench's breakdown.

MODE ``restore`` (under ``stalwart run --ckpt-ram``): the first attempt saves step 1
three ways (plain ``dcp.save``; stalwart's ``save`` without and with the RAM copy), and
rank 1 SIGKILLs itself; the restarted ranks then load it ARG times each way, dropping
the page cache before each: ``dcp.load``, ``load_newest`` from disk and from RAM, and
plain ``dcp.load`` with stalwart's ``DcpReader`` (from RAM). Rank 0
appends ``{"kind": "load", ...}`` lines; every load is checked against the sums saved.
"""

import json
import os
import signal
import sys
import time

SCRIPT_T, SCRIPT_CPU = time.time(), time.process_time()
# Forked from a template that had torch imported (stalwart's warm start), or not.
WARM = "torch" in sys.modules

from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from fsdp_common import App, complete_steps, every_rank, shard  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

mode, out, ckpt, mib, arg = (
    sys.argv[1],
    Path(sys.argv[2]),
    Path(sys.argv[3]),
    int(sys.argv[4]),
    int(sys.argv[5]),
)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
SIDE = 2048
env_rank = int(os.environ["RANK"])
timed = mode in ("plain", "stalwart")  # the crash section's modes; not the restore one


def stage(name: str, t: float | None = None, cpu: float | None = None) -> None:
    """One line per rank and stage in OUT/stages.jsonl (the bench's breakdown): wall
    time, the same clock under both launchers."""
    rec = {
        "rank": env_rank,
        "attempt": attempt,
        "stage": name,
        "t": time.time() if t is None else t,
        # This process's CPU seconds (every thread, since the fork that made it), which a
        # loaded host does not stretch.
        "cpu": time.process_time() if cpu is None else cpu,
    }
    fd = os.open(out / "stages.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())
    finally:
        os.close(fd)


if timed:
    # When the kernel made this process (a fork: the launcher's, or the template's), to
    # its 10 ms tick: /proc's start time counts from boot (psutil's create_time adds the
    # boot time, which /proc/stat gives in whole seconds only).
    with open("/proc/self/stat") as f:
        started = int(f.read().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
    stage("process", time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started), 0.0)
    stage("script", SCRIPT_T, SCRIPT_CPU)
    stage("torch_preimported" if WARM else "torch_not_preimported", SCRIPT_T, SCRIPT_CPU)
    stage("imported")
dist.init_process_group("gloo")
rank = dist.get_rank()
if timed:
    stage("process_group")


def log(**rec: object) -> None:
    if rank == 0:
        with open(out / "events.jsonl", "a") as f:
            f.write(json.dumps({**rec, "attempt": attempt, "t": time.time()}) + "\n")


torch.manual_seed(attempt)
layers = max(1, round(mib * 2**20 / (SIDE * SIDE * 4)))
model = shard(
    torch.nn.Sequential(*[torch.nn.Linear(SIDE, SIDE, bias=False) for _ in range(layers)])
)
optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
if timed:
    stage("model")


def train_step(step: int = 0) -> None:
    if timed:
        stage(f"step{step}_start")
    loss = model(torch.randn(4, SIDE)).square().mean()
    if timed:
        stage(f"step{step}_forward")
    loss.backward()
    if timed:
        stage(f"step{step}_backward")
    optim.step()
    optim.zero_grad()
    if timed:
        stage(f"step{step}_optimizer")


def local_sums() -> list[float]:
    """This rank's shards, summed (a check that a load restored what was saved)."""
    m, o = get_state_dict(model, optim)
    tensors = [*m.values(), *[v for s in o["state"].values() for v in s.values()]]
    return [float(t.to_local().double().sum()) for t in tensors if hasattr(t, "to_local")]


def drop_cache() -> None:
    dist.barrier()
    if rank == 0:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    dist.barrier()


if mode in ("plain", "stalwart"):
    state = {"app": App(model, optim)}
    step = 0
    if attempt:
        if mode == "plain":
            found = next(iter(complete_steps(ckpt)), None)
            if found is not None:
                dcp.load(state, checkpoint_id=ckpt / f"step_{found}")
                step = found
        else:
            from stalwart.checkpoint import dcp as sdcp

            step = sdcp.load_newest(state, ckpt) or 0
        log(kind="restored", step=step)
        stage("restored")
    while step < arg + 2:
        step += 1
        train_step(step)
        dist.barrier()
        log(kind="step", step=step)
        if attempt == 0 and step == arg:
            if mode == "plain":
                dcp.save(state, checkpoint_id=ckpt / f"step_{step}")
            else:
                from stalwart.checkpoint import dcp as sdcp

                sdcp.save(state, ckpt, step)
            dist.barrier()
            if rank == 1:
                # The crash: right after a save, as late as it can cost nothing.
                (out / "crash_at").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
elif mode == "restore":
    from stalwart.checkpoint import dcp as sdcp
    from stalwart.checkpoint.dcp_storage import DcpReader

    m, o = get_state_dict(model, optim)
    state = {"model": m, "optim": o}
    sums = out / f"sums_{rank}.json"
    if attempt == 0:
        train_step()
        m, o = get_state_dict(model, optim)
        state = {"model": m, "optim": o}
        dcp.save(state, checkpoint_id=ckpt / "plain")
        sdcp.save(state, ckpt / "disk", 1, ram=False)
        sdcp.save(state, ckpt / "ram", 1)
        sums.write_text(json.dumps(local_sums()))
        total = sum(
            t.to_local().numel() * t.element_size()
            for t in [*m.values(), *[v for s in o["state"].values() for v in s.values()]]
            if hasattr(t, "to_local")
        )
        sizes = torch.tensor([total])
        dist.all_reduce(sizes)
        log(kind="size", total_bytes=int(sizes.item()), layers=layers)
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # rank 0 waits here until the launcher stops it
    want = json.loads(sums.read_text())
    for rep in range(arg):
        for method in ("dcp.load", "load_newest disk", "load_newest ram", "DcpReader ram"):
            drop_cache()
            t0 = time.perf_counter()
            if method == "dcp.load":
                dcp.load(state, checkpoint_id=ckpt / "plain")
                got: int | None = 1
            elif method == "DcpReader ram":
                # What a program that calls DCP itself writes: plain dcp.load, stalwart's
                # reader, which takes the shards from RAM when every rank holds its share.
                dcp.load(state, storage_reader=DcpReader(ckpt / "ram" / "step_000000001"))
                got = 1
            else:
                root = ckpt / ("disk" if method.endswith("disk") else "ram")
                got = sdcp.load_newest(state, root)
            took = time.perf_counter() - t0
            dist.barrier()
            ok = every_rank(got == 1 and local_sums() == want)
            log(kind="load", method=method, rep=rep, took=took, ok=ok)
            # Scramble the state between loads so each one has to restore it.
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
                for s in optim.state.values():
                    for v in s.values():
                        if isinstance(v, torch.Tensor):
                            v.zero_()
else:
    raise SystemExit(f"dcp_crash_job.py: mode {mode!r}: expected plain, stalwart or restore")

dist.barrier()
dist.destroy_process_group()
