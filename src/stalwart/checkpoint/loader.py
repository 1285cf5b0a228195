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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import layout
from .errors import CheckpointCorruptError
from .identity import resolve_rank
from .manifest import Manifest, file_identity, read_manifest, verify_files

logger = logging.getLogger(__name__)

# Loads of one step racing re-saves of it: each retry needs the writer to have
# replaced the manifest during the previous try, so retrying costs one load per re-save
# and stops when re-saves stop.  A writer re-saving back to back on a loaded machine beat
# 20 tries in a full test run (the loader then skipped the only step), so the bound is
# time, not a count: a load that completes between two re-saves wins within it.
_RESAVE_PATIENCE_S = 10.0


@dataclass(frozen=True)
class Loaded:
    """A checkpoint that was found, verified and loaded."""

    step: int
    state_dict: Any
    path: Path
    # "disk", or "ram": from the launcher's snapshot memory (``path`` is its segment).
    source: str = "disk"


def verify_step(directory: str | os.PathLike[str], step: int, rank: int = 0) -> Manifest:
    """Check that ``step`` is complete and rank ``rank``'s file matches its manifest."""
    return _verify(layout.step_dir(Path(directory), step), step, rank)[0]


class _ReSaved(CheckpointCorruptError):
    """The data file was replaced while it was loaded: proof of a re-save in progress,
    even before the writer replaced the manifest (which is written after the data)."""


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    try:
        return file_identity(os.stat(path))
    except OSError:
        return None


def _verify(folder: Path, step: int, rank: int) -> tuple[Manifest, Path, tuple[int, int, int, int]]:
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
    data, identity = verify_files(folder, manifest)
    return manifest, folder / data, identity


def load_step(
    directory: str | os.PathLike[str],
    step: int,
    rank: int = 0,
    *,
    map_location: Any = "cpu",
    weights_only: bool = True,
) -> Loaded:
    """Verify and load one step; raises CheckpointCorruptError if it does not verify."""
    _, path, checked = _verify(layout.step_dir(Path(directory), step), step, rank)
    # The bytes match what the writer produced, so a failure here is not
    # corruption (e.g. a class refused by weights_only): let it propagate.
    state = torch.load(path, map_location=map_location, weights_only=weights_only)
    if _stamp(path) != checked:
        # A re-save replaced the file after it was checked: what torch.load
        # read may not be what was verified. The caller may look again.
        raise _ReSaved(f"{path} was replaced while it was loaded (a re-save)")
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


def _load_settled(
    root: Path, step: int, rank: int, map_location: Any, weights_only: bool
) -> Loaded:
    """``load_step``, looked at again when a running writer re-saved the step meanwhile.

    A re-save replaces the manifest (a new file) and may delete the data file
    it named, so a load racing it can fail although the new version is whole.
    """
    manifest = layout.step_dir(root, step) / layout.manifest_name(rank)
    give_up = time.monotonic() + _RESAVE_PATIENCE_S
    while True:
        before = _stamp(manifest)
        try:
            return load_step(root, step, rank, map_location=map_location, weights_only=weights_only)
        except (CheckpointCorruptError, OSError) as exc:
            resaved = isinstance(exc, _ReSaved) or _stamp(manifest) != before
            if before is None or not resaved or time.monotonic() > give_up:
                raise
            logger.debug("step %d was re-saved while it was loaded; looking again", step)


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
            loaded = _load_settled(root, step, rank, map_location, weights_only)
        except (CheckpointCorruptError, OSError) as exc:
            # OSError: a file vanished or became unreadable between the check
            # and torch.load.
            if pointer is not None and step > pointer:
                # Newer than `latest`: most likely a save that was cut short.
                logger.warning("skipping unfinished checkpoint step %d: %s", step, exc)
            else:
                logger.warning("skipping corrupt checkpoint step %d: %s", step, exc)
            continue
        logger.info("loaded checkpoint step %d for rank %d from %s", step, rank, loaded.path)
        return loaded
    return None
