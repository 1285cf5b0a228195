"""What bench_ram.py and its DLRover run (another venv, no stalwart) share: torch only.

The same model, state and timing for both sides, so the figures compare like with like.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def make_state(mib: int, tensors: int = 8) -> dict[str, torch.Tensor]:
    """``mib`` MiB of float32 in ``tensors`` tensors, written (its pages are in)."""
    n = (mib << 20) // 4 // tensors
    return {f"t{i}": torch.full((n,), float(i)) for i in range(tensors)}


def make_model(mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """A 4-layer MLP + Adam whose parameters and moments total about ``mib`` MiB."""
    torch.manual_seed(0)
    # Adam keeps two moments per parameter: parameters are a third of the state.
    width = int(((mib << 20) / 3 / 4 / 4) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(32, width)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step()
    return model, opt, step


def state_mib(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    tensors: list[Any] = [*model.state_dict().values()]
    tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def timed_blocks(
    step: Callable[[], None], save: Callable[[int], None], blocks: int, per_block: int
) -> tuple[list[float], list[float], list[float]]:
    """Step times without saves, with a save after every step, and the time in save().

    Blocks without and with saves alternate; the first step of each block is dropped,
    so a background copy started in a saving block does not count against the next
    block without saves.
    """
    plain: list[float] = []
    saving: list[float] = []
    inside: list[float] = []
    n = 0
    for b in range(2 * blocks):
        with_save = b % 2 == 1
        for i in range(per_block):
            t0 = time.perf_counter()
            step()
            if with_save:
                n += 1
                t1 = time.perf_counter()
                save(n)
                inside.append(time.perf_counter() - t1)
            if i:
                (saving if with_save else plain).append(time.perf_counter() - t0)
    return plain, saving, inside
