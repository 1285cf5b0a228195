"""The tiny FSDP2 model, data position and state checks the DCP test workers share
(imported by scripts in this folder, which run with it on ``sys.path``)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard


class DataPosition:
    """Where the data loader is: a Stateful DCP saves and restores by itself."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.index = int(sd["index"])


class App:
    """The torchtitan pattern: model and optimizer as one Stateful."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, object]:
        m, o = get_state_dict(self.model, self.optim)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        set_state_dict(
            self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16), torch.nn.Linear(16, 8)
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, data: DataPosition, n: int) -> None:
    for _ in range(n):
        g = torch.Generator().manual_seed(1000 + data.index)
        x = torch.randn(8, 24, generator=g)
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        data.index += 1


def full_state(
    model: torch.nn.Module, optim: torch.optim.Optimizer, data: DataPosition
) -> dict[str, object]:
    """The gathered (unsharded) state: collective."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, optim, options=opts),
        "data": data.index,
    }


def same(a: object, b: object, where: str = "") -> None:
    """Assert ``a`` equals ``b`` bit for bit (tensors: dtype and every element)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b))
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)
