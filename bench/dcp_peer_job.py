"""bench_dcp.py's peer section: an FSDP2 rank per simulated host under
``stalwart run --ckpt-ram --ckpt-replicas 1`` (no ``__main__`` guard, like most training
scripts).

    dcp_peer_job.py OUT CKPT MIB REPEATS

``MIB`` of ``Linear(2048, 2048)`` parameters, fully sharded, with AdamW (three times the
bytes in all), 2 ranks (one per node) on gloo. The first attempt trains a step, saves it
as a plain ``dcp.save`` folder (``CKPT/plain``) and through stalwart's ``dcp.save``
(``CKPT/ram``, step 1, with its RAM copy, which the launcher replicates to the peer
node), then rank 1 writes its pid to ``OUT/paused`` and waits for its node to be lost
(rank 0 waits in a barrier). In the next attempt, rank 1 runs on the spare that took the
lost node's place, which holds no shard of its own: each way ``REPEATS`` times, the page
cache dropped before each load, the ranks load the step with ``dcp.load`` (the plain
folder), ``load_newest`` (rank 1's shards from the replica node a held, which the spare
fetched) and plain ``dcp.load`` with stalwart's ``DcpReader``. Rank 0 appends
``{"kind": "load", ...}`` lines to ``OUT/events.jsonl``; every load is checked against
the per-tensor sums saved.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_common import every_rank, shard
from torch.distributed.checkpoint.state_dict import get_state_dict

from stalwart.checkpoint import dcp as sdcp
from stalwart.checkpoint.dcp_storage import DcpReader

out, ckpt, mib, repeats = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
SIDE = 2048
METHODS = ("dcp.load", "load_newest peer replica", "DcpReader peer replica")

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
layers = max(1, round(mib * 2**20 / (SIDE * SIDE * 4)))
model = shard(
    torch.nn.Sequential(*[torch.nn.Linear(SIDE, SIDE, bias=False) for _ in range(layers)])
)
optim = torch.optim.AdamW(model.parameters(), lr=1e-4)


def log(**rec: object) -> None:
    if rank == 0:
        with open(out / "events.jsonl", "a") as f:
            f.write(json.dumps({**rec, "attempt": attempt, "t": time.time()}) + "\n")


def tensors() -> list[torch.Tensor]:
    m, o = get_state_dict(model, optim)
    every = [*m.values(), *[v for s in o["state"].values() for v in s.values()]]
    return [t.to_local() for t in every if hasattr(t, "to_local")]


def local_sums() -> list[float]:
    return [float(t.double().sum()) for t in tensors()]


def state() -> dict[str, object]:
    m, o = get_state_dict(model, optim)
    return {"model": m, "optim": o}


def drop_cache() -> None:
    dist.barrier()
    if rank == 0:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    dist.barrier()


# Each rank keeps its own sums: rank 1's file is written on node b and read on the spare
# (one file system: the hosts are network namespaces).
sums = out / f"sums_{rank}.json"
if attempt == 0:
    model(torch.randn(4, SIDE)).square().mean().backward()
    optim.step()
    optim.zero_grad()
    dcp.save(state(), checkpoint_id=ckpt / "plain")
    sdcp.save(state(), ckpt / "ram", 1)
    sums.write_text(json.dumps(local_sums()))
    size = torch.tensor([sum(t.numel() * t.element_size() for t in tensors())])
    dist.all_reduce(size)
    log(kind="size", total_bytes=int(size.item()), layers=layers)
    dist.barrier()
    if rank == 1:
        (out / "paused").write_text(str(os.getpid()))
        while True:  # until the bench takes this node away
            time.sleep(1)
    dist.barrier()  # rank 0: until the lost node's connection resets
want = json.loads(sums.read_text())
for rep in range(repeats):
    for method in METHODS:
        drop_cache()
        sd = state()
        t0 = time.perf_counter()
        if method == "dcp.load":
            dcp.load(sd, checkpoint_id=ckpt / "plain")
            got: int | None = 1
        elif method.startswith("DcpReader"):
            dcp.load(sd, storage_reader=DcpReader(ckpt / "ram" / "step_000000001"))
            got = 1
        else:
            got = sdcp.load_newest(sd, ckpt / "ram")
        took = time.perf_counter() - t0
        dist.barrier()
        ok = every_rank(got == 1 and local_sums() == want)
        log(kind="load", method=method, rep=rep, took=took, ok=ok)
        # Scrambled between loads, so each one has to restore the state.
        with torch.no_grad():
            for t in tensors():
                t.zero_()
dist.barrier()
dist.destroy_process_group()
