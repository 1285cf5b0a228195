"""The read-only mappings a worker reads the launcher's snapshot segments through: one
per segment file, kept for the life of the process.

A restore of a sharded step (``dcp_ram``) used to map every segment afresh and unmap it
at the end. Each fresh mapping costs a page-table fill of the slot it reads (a fault
per page, or one ``MADV_POPULATE_READ`` pass), forgets that its slot was verified, so
the next restore in the process hashed the same bytes again, and unmapping at the end
of the restore sat on the critical path too. A mapping kept here is verified once per
record (:meth:`RamSegment.verify`'s rule: an unchanged commit record means unchanged
bytes, since every writer clears the record before it touches the data), already
populated by the hash that verified it, and never unmapped on a restore's path.

:func:`precheck` starts that one verification on a thread as soon as a worker starts
(the launcher's bootstrap calls it under ``--ckpt-ram``): a restarted rank hashes its
newest shard set while its program imports, sets up its process group and builds its
model, instead of at the restore.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from stalwart.base import envvars

from . import ramlayout as rl
from .errors import CheckpointError
from .ram import RamSegment

logger = logging.getLogger(__name__)


class SharedSegments:
    """This process's read-only mappings of segment files, by path; a file replaced
    since it was mapped (another inode at the path) is mapped again."""

    def __init__(self) -> None:
        self._held: dict[Path, RamSegment] = {}
        self._lock = threading.Lock()

    def get(self, path: Path) -> RamSegment | None:
        """The mapping of ``path`` (None, logged, when it cannot be mapped)."""
        with self._lock:
            seg = self._held.get(path)
            if seg is not None and seg.maps(path):
                return seg
            if seg is not None:
                del self._held[path]
                seg.close()
            try:
                seg = RamSegment.open(path, writable=False)
            except (OSError, ValueError, CheckpointError) as exc:
                logger.warning("skipping snapshot segment %s: %s", path, exc)
                return None
            self._held[path] = seg
            return seg

    def prune(self) -> None:
        """Unmap the segments whose files are gone or replaced (a launcher that made a
        new folder, a test's): a mapping would keep their memory alive."""
        with self._lock:
            stale = [p for p, seg in self._held.items() if not seg.maps(p)]
            gone = [self._held.pop(p) for p in stale]
        for seg in gone:
            seg.close()

    def close(self) -> None:
        """Unmap every segment (their pages stay the launcher's)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for seg in held:
            seg.close()


#: The process's mappings (sharded restores and their pre-check share them).
SEGMENTS = SharedSegments()


def segment_paths(folder: Path) -> list[Path]:
    """The segment files in ``folder``, sorted ([] when it cannot be listed)."""
    try:
        return sorted(p for p in folder.iterdir() if p.name.endswith(rl.SEGMENT_SUFFIX))
    except OSError:
        return []


def precheck(folder: Path, rank: int) -> int:
    """Start verifying, on a thread per segment, the newest shard set of saving rank
    ``rank`` that each segment in ``folder`` holds (the set a restarted rank most
    likely serves); how many were started."""
    started = 0
    for path in segment_paths(folder):
        seg = SEGMENTS.get(path)
        if seg is not None and seg.start_checking(rank, None, rl.KIND_DCP):
            started += 1
    return started


def precheck_from_env() -> int:
    """:func:`precheck` for this worker (``RANK``) under ``stalwart run --ckpt-ram``; 0
    elsewhere, or when the segments hold no shard set of its rank."""
    folder = os.environ.get(rl.RAM_DIR_ENV)
    rank = os.environ.get(envvars.RANK, "")
    if not folder or not rank.isdigit() or not Path(folder).is_dir():
        return 0
    return precheck(Path(folder), int(rank))
