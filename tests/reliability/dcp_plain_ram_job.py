"""An FSDP2 job on gloo that calls DCP itself, as torchtitan and FSDP2 examples do, for
``stalwart run --ckpt-ram``. No ``__main__`` guard. Each start appends a line to
``<out>/starts``; each resume appends ``<rank> <step> <data position>`` to
``<out>/resumes``.

argv: <mode> <out> <root> <last step>
  writer  ``dcp.save(storage_writer=DcpWriter(root, step))`` and
          ``dcp.load(storage_reader=DcpReader(folder))``: no other stalwart API. In the
          first attempt, once step 3 is saved, rank 1 flips a byte in every shard file of
          step 3 on disk (so only RAM holds it whole) and SIGKILLs itself.
  plain   never imports stalwart: ``dcp.save``/``dcp.load`` with ``checkpoint_id``; rank
          1 SIGKILLs itself once step 3 is saved in the first attempt.
Both resume from the newest step folder with DCP metadata and check the gathered state
against the one rank 0 recorded when it was saved, bit for bit.
"""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_setup import App, DataPosition, build, full_state, same, train

mode, out, root, last = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
with open(out / "starts", "a") as f:
    f.write(f"{os.getpid()}\n")
if mode == "writer":
    from stalwart.checkpoint.dcp_storage import DcpReader, DcpWriter

dist.init_process_group("gloo")
rank = dist.get_rank()
model, optim = build(seed=1)
data = DataPosition()
state = {"app": App(model, optim), "data": data}


def newest() -> int | None:
    found = [
        int(p.name[5:])
        for p in root.glob("step_*")
        if p.name[5:].isdigit() and (p / ".metadata").is_file()
    ]
    return max(found, default=None)


loaded = newest()
if loaded is not None:
    folder = root / f"step_{loaded:09d}"
    if mode == "writer":
        dcp.load(state, storage_reader=DcpReader(folder))
    else:
        dcp.load(state, checkpoint_id=folder)
    full = full_state(model, optim, data)
    if rank == 0:
        same(torch.load(out / f"full_{loaded}.pt", weights_only=True), full)
with open(out / "resumes", "a") as f:
    f.write(f"{rank} {loaded} {data.index}\n")
for step in range((loaded or 0) + 1, last + 1):
    train(model, optim, data, 2)
    folder = root / f"step_{step:09d}"
    if mode == "writer":
        dcp.save(state, storage_writer=DcpWriter(root, step))
    else:
        dcp.save(state, checkpoint_id=folder)
    full = full_state(model, optim, data)
    if rank == 0:
        torch.save(full, out / f".full_{step}.tmp")
        os.replace(out / f".full_{step}.tmp", out / f"full_{step}.pt")
    dist.barrier()  # the reference is written before rank 1 may end the attempt
    crashed = out / "crashed"
    if step == 3 and rank == 1 and not crashed.exists():
        crashed.write_text("")
        if mode == "writer":
            for shard in folder.glob("*.distcp"):
                with open(shard, "r+b") as f:
                    f.seek(shard.stat().st_size // 2)
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte[0] ^ 0xFF]))
        os.kill(os.getpid(), signal.SIGKILL)

dist.barrier()
dist.destroy_process_group()
