"""Where a process group's collectives take their tensors.

A group made with NCCL alone (``init_process_group("nccl")``, what every GPU example
does) refuses CPU tensors ("No backend type associated with device type cpu"), and a
gloo group refuses CUDA ones; a group made with ``"cpu:gloo,cuda:nccl"`` takes both.
stalwart's own small collectives on a caller's group (agreeing on a step, exchanging
RAM offers) build their tensors where the group takes them; the decision is a pure
function of the backend's name, the one torch reports with ``dist.get_backend``.
"""

from __future__ import annotations

from typing import Any

#: Backends that take CPU tensors when named alone.
_CPU_BACKENDS = frozenset({"gloo", "mpi", "ucc", "fake"})


def device_type_for(backend: str, accelerator: str = "cuda") -> str:
    """``"cpu"`` when a group of ``backend`` takes CPU tensors, else the device type of its
    accelerator: ``"nccl"`` -> ``"cuda"``; ``"cpu:gloo,cuda:nccl"`` -> ``"cpu"``;
    ``"cuda:nccl"`` -> ``"cuda"``; an unknown single backend -> ``accelerator``."""
    name = backend.strip().lower()
    if ":" in name:
        types = [part.split(":", 1)[0].strip() for part in name.split(",") if ":" in part]
        if "cpu" in types:
            return "cpu"
        return types[0] if types and types[0] else accelerator
    if name in _CPU_BACKENDS or not name:
        return "cpu"
    if name == "nccl":
        return "cuda"
    return accelerator


def group_device(group: Any = None) -> Any:
    """The ``torch.device`` for a collective's tensors on ``group`` (the default group
    when None): the CPU, or the current device of the group's accelerator."""
    import torch
    import torch.distributed as dist

    accel = "cuda"
    current = getattr(torch, "accelerator", None)
    if current is not None:
        found = current.current_accelerator()
        if found is not None:
            accel = found.type
    kind = device_type_for(str(dist.get_backend(group)), accel)
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    index = current.current_device_index() if current is not None else 0
    return torch.device(kind, index)
