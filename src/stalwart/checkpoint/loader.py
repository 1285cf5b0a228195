"""Finding and loading the newest checkpoint that verifies.

Loading never trusts the ``latest`` pointer alone: it walks the step folders
newest first and takes the first one that is complete (every rank committed)
and whose file for this rank matches its manifest. Torn, incomplete, corrupt
or unreadable steps (a manifest that cannot be read or names no data file, a
folder or file the process may not read) are skipped with a warning.

Files are read with ``torch.load(weights_only=True)`` by default, which
refuses to run arbitrary code from a file; pass ``weights_only=False`` only
for checkpoints from a trusted writer that contain custom classes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import layout
from .errors import CheckpointCorruptError
from .identity import resolve_rank
from .manifest import Manifest, read_manifest, verify_files

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loaded:
    """A checkpoint that was found, verified and loaded."""

    step: int
    state_dict: Any
    path: Path


def verify_step(directory: str | os.PathLike[str], step: int, rank: int = 0) -> Manifest:
    """Check that ``step`` is complete and rank ``rank``'s file matches its manifest."""
    return _verify(layout.step_dir(Path(directory), step), step, rank)[0]


def _verify(folder: Path, step: int, rank: int) -> tuple[Manifest, Path]:
    manifest = read_manifest(folder / layout.manifest_name(rank))
    if manifest.step != step or manifest.rank != rank or manifest.world_size <= rank:
        raise CheckpointCorruptError(
            f"{folder}: manifest says step {manifest.step} rank {manifest.rank} "
            f"world size {manifest.world_size}, expected step {step} rank {rank}"
        )
    try:
        committed = layout.ranks_committed(folder)
    except OSError as exc:
        raise CheckpointCorruptError(
            f"cannot list {folder}: {exc.strerror or exc} (errno {exc.errno})"
        ) from exc
    missing = set(range(manifest.world_size)) - committed
    if missing:
        raise CheckpointCorruptError(f"{folder}: ranks {sorted(missing)} never committed")
    return manifest, folder / verify_files(folder, manifest)


def load_step(
    directory: str | os.PathLike[str],
    step: int,
    rank: int = 0,
    *,
    map_location: Any = "cpu",
    weights_only: bool = True,
) -> Loaded:
    """Verify and load one step; raises CheckpointCorruptError if it does not verify."""
    _, path = _verify(layout.step_dir(Path(directory), step), step, rank)
    # The bytes match what the writer produced, so a failure here is not
    # corruption (e.g. a class refused by weights_only): let it propagate.
    state = torch.load(path, map_location=map_location, weights_only=weights_only)
    return Loaded(step=step, state_dict=state, path=path)


def complete_steps(directory: str | os.PathLike[str], world_size: int | None = None) -> list[int]:
    """Steps whose folder holds every rank's manifest, newest first (not checksummed)."""
    root = Path(directory)
    out = []
    for step in layout.list_steps(root):
        folder = layout.step_dir(root, step)
        committed = layout.ranks_committed(folder)
        if not committed:
            continue
        if world_size is None:
            try:
                sample = read_manifest(folder / layout.manifest_name(min(committed)))
            except CheckpointCorruptError:
                continue
            needed = sample.world_size
        else:
            needed = world_size
        if committed.issuperset(range(needed)):
            out.append(step)
    return out


def load_latest(
    directory: str | os.PathLike[str],
    rank: int | None = None,
    *,
    map_location: Any = "cpu",
    weights_only: bool = True,
) -> Loaded | None:
    """Load the newest checkpoint of ``rank`` that is complete and verifies, or None.

    ``rank`` defaults to ``RANK``, then an initialised process group, then 0.
    """
    root = Path(directory)
    rank = resolve_rank(rank)
    pointer = layout.read_latest(root)
    for step in layout.list_steps(root):
        try:
            loaded = load_step(
                root, step, rank, map_location=map_location, weights_only=weights_only
            )
        except (CheckpointCorruptError, OSError) as exc:
            # OSError: the data file vanished or became unreadable between the
            # check and torch.load (e.g. replaced by a concurrent re-save).
            if pointer is not None and step > pointer:
                # Newer than `latest`: most likely a save that was cut short.
                logger.warning("skipping unfinished checkpoint step %d: %s", step, exc)
            else:
                logger.warning("skipping corrupt checkpoint step %d: %s", step, exc)
            continue
        logger.info("loaded checkpoint step %d for rank %d from %s", step, rank, loaded.path)
        return loaded
    return None
