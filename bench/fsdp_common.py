"""What the FSDP2 bench jobs (dcp_crash_job.py, fsdp_resize_job.py) share: the
torchtitan-style ``Stateful`` over model and optimizer, sharding a model layer by layer,
and finding the complete steps a plain ``dcp.save`` left. Plain torch only: the jobs
run under torchrun as well, and one of them never imports stalwart."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard


class App:
    """Model and optimizer as one ``Stateful`` (the torchtitan pattern)."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, object]:
        m, o = get_state_dict(self.model, self.optim)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        set_state_dict(
            self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )


def shard(model: torch.nn.Sequential) -> torch.nn.Sequential:
    """``fully_shard`` each linear layer, then the whole model (FSDP2's usual wrapping)."""
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def complete_steps(ckpt: Path) -> list[int]:
    """Steps under ``ckpt`` (``step_<N>`` folders) whose global ``.metadata`` is on disk,
    newest first: DCP writes it last, after every rank's shards, so a step without it
    is incomplete."""
    found = [
        int(p.name[5:])
        for p in ckpt.glob("step_*")
        if p.name[5:].isdigit() and (p / ".metadata").exists()
    ]
    return sorted(found, reverse=True)


def every_rank(ok: bool) -> bool:
    """True on every rank when ``ok`` is true on every rank (a collective)."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
