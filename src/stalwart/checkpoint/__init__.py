"""Asynchronous, atomic, checksummed checkpoints for training loops.

``AsyncCheckpointer.save`` snapshots a state dict into a reusable shared-memory
buffer and hands it to a per-rank writer subprocess that writes a plain
``torch.save`` file, fsyncs it and renames it into place. ``load_latest``
returns the newest checkpoint that verifies. See docs/checkpoint.md.
"""

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
from .loader import Loaded, complete_steps, load_latest, load_step, verify_step
from .process import CheckpointProcess, CheckpointProcessConfig, WriterProcessConfig
from .writer import SaveResult, TorchFileWriter

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
    "TorchFileWriter",
    "WriterDiedError",
    "WriterError",
    "WriterProcessConfig",
    "complete_steps",
    "load_latest",
    "load_step",
    "verify_step",
]
