"""Asynchronous, atomic, checksummed checkpoints for training loops.

``AsyncCheckpointer.save`` snapshots a state dict into a reusable shared-memory
buffer and hands it to a per-rank writer subprocess that writes a plain
``torch.save`` file, fsyncs it and renames it into place. Under
``stalwart run --ckpt-ram`` snapshots are also kept in memory the launcher owns,
so a restarted worker restores without reading the disk; ``restore`` picks the
step every rank can load. ``load_latest`` returns the newest checkpoint that
verifies. See docs/checkpoint.md.

The names are imported on first use: the launcher imports ``ramlayout`` (the
names it shares with workers) without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checkpointer import AsyncCheckpointer, CheckpointerConfig, StagingMode
    from .child import CheckpointWriter
    from .errors import (
        CheckpointCorruptError,
        CheckpointError,
        StagingConflictError,
        WriterDiedError,
        WriterError,
    )
    from .identity import RankInfo
    from .inplace import StateMismatchError
    from .loader import Loaded, complete_steps, load_latest, load_step, verify_step
    from .process import CheckpointProcess
    from .process_args import CheckpointProcessConfig, WriterProcessConfig
    from .resume import restore
    from .writer import SaveResult, TorchFileWriter

_WHERE = {
    "AsyncCheckpointer": "checkpointer",
    "CheckpointerConfig": "checkpointer",
    "StagingMode": "checkpointer",
    "CheckpointWriter": "child",
    "CheckpointCorruptError": "errors",
    "CheckpointError": "errors",
    "StagingConflictError": "errors",
    "WriterDiedError": "errors",
    "WriterError": "errors",
    "RankInfo": "identity",
    "StateMismatchError": "inplace",
    "Loaded": "loader",
    "complete_steps": "loader",
    "load_latest": "loader",
    "load_step": "loader",
    "verify_step": "loader",
    "CheckpointProcess": "process",
    "CheckpointProcessConfig": "process_args",
    "WriterProcessConfig": "process_args",
    "restore": "resume",
    "SaveResult": "writer",
    "TorchFileWriter": "writer",
}

__all__ = [
    "AsyncCheckpointer",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointProcess",
    "CheckpointProcessConfig",
    "CheckpointWriter",
    "CheckpointerConfig",
    "Loaded",
    "RankInfo",
    "SaveResult",
    "StagingConflictError",
    "StagingMode",
    "StateMismatchError",
    "TorchFileWriter",
    "WriterDiedError",
    "WriterError",
    "WriterProcessConfig",
    "complete_steps",
    "load_latest",
    "load_step",
    "restore",
    "verify_step",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
