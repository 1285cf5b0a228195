"""The restricted unpickler of a RAM snapshot's skeleton.

A snapshot's state is a pickle of its structure (the "skeleton") whose tensors are
persistent ids (`TensorRef`) into the slot's data.  The segment lives in memory the
launcher owns, so the skeleton is never trusted: with ``weights_only`` only plain
containers and torch's value types are built, and every tensor reference gets a fresh
tensor (or is bound in place by the caller, see ``ram.RamSegment.read``).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from .staging import TensorRef

_SAFE_GLOBALS = {
    ("collections", "OrderedDict"),
    ("builtins", "complex"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("torch", "Size"),
    ("torch", "device"),
    ("stalwart.checkpoint.staging", "TensorRef"),
}


class SkeletonUnpickler(pickle.Unpickler):
    """Rebuilds a skeleton, allocating a fresh tensor for every reference in it."""

    def __init__(
        self, file: io.BytesIO, wanted: list[tuple[torch.Tensor, TensorRef]], weights_only: bool
    ) -> None:
        super().__init__(file)
        self._wanted = wanted
        self._weights_only = weights_only
        self._seen: dict[int, int] = {}  # offset -> index in wanted
        # How often each wanted tensor appears in the state, and which one each object
        # handed out stands for (a Parameter wraps it); the objects are kept alive here
        # so their ids stay theirs.
        self.uses: list[int] = []
        self.index_of: dict[int, int] = {}
        self._handed: list[torch.Tensor] = []

    def find_class(self, module: str, name: str) -> Any:
        if not self._weights_only:
            return super().find_class(module, name)
        if (module, name) in _SAFE_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not allowed with weights_only=True "
            "(pass weights_only=False only for snapshots of a trusted job)"
        )

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, TensorRef):
            raise pickle.UnpicklingError(f"unexpected persistent id {type(pid).__name__}")
        i = self._seen.get(pid.offset) if pid.nbytes else None
        if i is None:
            # Not yet touched: restoring in place leaves most of these untouched, and
            # an untouched allocation costs next to nothing.
            t = torch.empty(pid.shape, dtype=pid.dtype)
            if t.numel() * t.element_size() != pid.nbytes:
                raise pickle.UnpicklingError("tensor reference with inconsistent size")
            i = len(self._wanted)
            self._wanted.append((t, pid))
            self.uses.append(0)
            if pid.nbytes:
                self._seen[pid.offset] = i
        t = self._wanted[i][0]
        out = torch.nn.Parameter(t, requires_grad=pid.requires_grad) if pid.parameter else t
        self.uses[i] += 1
        self.index_of[id(out)] = i
        self._handed.append(out)
        return out
