"""The RAM side of a plain ``dcp.load(storage_reader=DcpReader(step_folder))``.

Under ``stalwart run --ckpt-ram`` each loading rank looks, while DCP plans the load, for
verified RAM copies of every shard file its plan reads, of the very save the folder's
commit record names (its token). Whether it found them travels to DCP's coordinator in
the rank's own load plan (:class:`RamVote`), the coordinator's answer back in the plan
DCP scatters: so every rank reads RAM, or every rank reads disk, without a collective of
stalwart's own and whatever process group the caller gave DCP.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from . import layout
from .dcp_ram import (
    HeldSet,
    HeldShards,
    find_all_shards,
    first_verified,
    root_key,
    shard_owner,
    shard_views,
)
from .dcp_records import COMMIT_NAME, DcpCommit
from .dcp_storage import read_record
from .errors import CheckpointError
from .ram import ram_folder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RamVote:
    """In a rank's load plan: whether it can read its share from RAM; in the plan DCP
    hands back: whether every rank reads from RAM."""

    ok: bool


def agreed(votes: Iterable[object]) -> bool:
    """Every rank voted for RAM (a plan without a vote, from a reader that does not
    take part, counts against)."""
    seen = list(votes)
    return bool(seen) and all(isinstance(v, RamVote) and v.ok for v in seen)


class RamSource:
    """The verified RAM copies of the shard files one rank's load reads, through the
    process's mappings (pages faulted in by the hash), viewed until :meth:`close`."""

    def __init__(self, step: int, held: list[HeldShards], files: dict[str, memoryview]) -> None:
        self.step = step
        self.held = held
        self.files = files

    @property
    def where(self) -> str:
        return ",".join(sorted({str(h.path) for h in self.held})) or "ram"

    def check_unchanged(self) -> None:
        """Raise if a slot read in place was reused meanwhile (the read may be torn)."""
        for h in self.held:
            if h.segment.record(h.slot) != h.record:
                raise CheckpointError(f"{h.path} slot {h.slot}: overwritten while read")

    def close(self) -> None:
        """Let go of the views; the mappings stay the process's (``ramshared``)."""
        for view in self.files.values():
            view.release()
        self.files = {}
        self.held = []


def find_source(
    ram_dir: Path, commit: DcpCommit, root: Path, needed: set[str], rank: int
) -> tuple[RamSource | None, str]:
    """The RAM copies of ``needed`` (file names of committed step ``commit.step`` of
    ``root``) held on this node, all of the save ``commit.save``; None and why not."""
    owners = {shard_owner(n) for n in needed}
    if None in owners:
        return None, "the load reads a file that is not a shard file"
    ranks = {r for r in owners if r is not None}
    from .resume import wait_for_fetch

    wait_for_fetch(ram_dir, rank)
    found = find_all_shards(ram_dir, root_key(root), step=commit.step, ranks=ranks)
    copies = [
        h for h in found if h.index.world_size == commit.world_size and h.index.save == commit.save
    ]
    # Only the sets this rank reads are hashed, each once (its first copy that verifies).
    mine: list[HeldShards] = []
    for saved in sorted(ranks):
        good = first_verified(
            copies, HeldSet(commit.step, commit.world_size, saved, commit.save), rank
        )
        if good is not None:
            mine.append(good)
    source = RamSource(commit.step, mine, {})
    try:
        for h in mine:
            got, _ = shard_views(h)
            source.files.update(got)
    except (OSError, CheckpointError, ValueError) as exc:
        source.close()
        return None, f"unreadable: {exc}"
    for name in sorted(needed):
        view = source.files.get(name)
        entry = commit.files.get(name)
        if view is None or entry is None or len(view) != entry.size:
            source.close()
            return None, f"{name} is not held whole in this node's RAM"
    return source, ""


def offer(step_folder: Path, needed: set[str], rank: int) -> RamSource | None:
    """What this rank can read of ``step_folder`` from RAM, or None (it reads disk)."""
    ram_dir, _ = ram_folder()
    step = layout.parse_step(step_folder.name)
    if ram_dir is None or step is None or not (step_folder / COMMIT_NAME).is_file():
        return None
    try:
        commit = read_record(step_folder / COMMIT_NAME, DcpCommit)
    except CheckpointError as exc:
        logger.warning("rank %d: reading %s from disk: %s", rank, step_folder, exc)
        return None
    if not commit.save or commit.step != step:
        return None
    source, why = find_source(ram_dir, commit, step_folder.parent, needed, rank)
    if source is None:
        logger.info("rank %d: reading step %d from disk: %s", rank, step, why)
    return source
