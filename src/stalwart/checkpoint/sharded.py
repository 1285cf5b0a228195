"""Whether a state dict is one for DCP: it holds DTensors or ``Stateful`` objects.

Asked on every ``AsyncCheckpointer.save``, so it imports nothing: a process that
never imported ``torch.distributed.tensor`` cannot hold a DTensor.
"""

from __future__ import annotations

import sys
from typing import Any

_MAX_DEPTH = 6


def is_stateful(obj: Any) -> bool:
    """DCP's ``Stateful`` protocol: an object that saves and loads itself."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def holds_sharded(obj: Any, depth: int = 0) -> bool:
    """True when ``obj`` (a state dict) holds a DTensor, or a ``Stateful`` at its top
    level (the torchtitan pattern: ``{"app": AppState(model, optimizer)}``)."""
    tensor_mod = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(tensor_mod, "DTensor", None) if tensor_mod is not None else None
    if depth == 0 and isinstance(obj, dict) and any(is_stateful(v) for v in obj.values()):
        return True
    return dtensor is not None and _has(obj, dtensor, depth)


def _has(obj: Any, kind: type, depth: int) -> bool:
    if isinstance(obj, kind):
        return True
    if depth >= _MAX_DEPTH:
        return False
    if isinstance(obj, dict):
        return any(_has(v, kind, depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has(v, kind, depth + 1) for v in obj)
    return False
