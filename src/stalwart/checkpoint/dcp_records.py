"""What stalwart adds to a DCP checkpoint folder, and the pure rules over it.

A step saved through :class:`~stalwart.checkpoint.dcp_storage.DcpWriter` is a plain
DCP folder (``__<r>_<i>.distcp`` shards and ``.metadata``, which ``dcp.load`` reads
as is) plus two kinds of JSON record::

    <root>/step_000000100/
      __0_0.distcp  __1_0.distcp  .metadata       # DCP's own files
      __0_.stalwart.json  __1_.stalwart.json      # per rank: its shards, sizes, checksums
      stalwart.commit.json                        # by the coordinator, last: every file

The commit record is written only after every rank's shards were fsync'd and
DCP's metadata was renamed into place, so its presence is what makes a step
complete. A folder with ``.metadata`` and no commit record is either a plain
``dcp.save`` (loadable, nothing to verify beyond sizes) or a save that died before
its commit, which :func:`classify` tells apart by the per-rank records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from .manifest import FileEntry

FORMAT_VERSION = 1
COMMIT_NAME = "stalwart.commit.json"
METADATA_NAME = ".metadata"
RANK_SUFFIX = ".stalwart.json"
#: Records and DCP metadata larger than this are not read (a hostile folder could
#: hold a file of any size; a real ``.metadata`` of a billion-parameter model is MBs).
MAX_RECORD_BYTES = 64 << 20
MAX_METADATA_BYTES = 512 << 20


class RankShards(msgspec.Struct, frozen=True):
    """One rank's share of a step: the files it wrote, fsync'd before this record."""

    format: int
    step: int
    prefix: str
    files: dict[str, FileEntry]


class DcpCommit(msgspec.Struct, frozen=True):
    """The coordinator's commit record: every file of the step, ``.metadata`` included."""

    format: int
    step: int
    world_size: int
    files: dict[str, FileEntry]
    created_unix: float
    #: The save's token, shared by every rank's RAM copy of its shards (``--ckpt-ram``):
    #: a reader takes the shards from RAM only when their token is this one.
    save: str = ""


#: A save token is a few hex digits; a longer one in a record read back is refused.
MAX_SAVE_TOKEN = 64


def rank_record_name(prefix: str) -> str:
    """The per-rank record of the rank whose shard files start with ``prefix``."""
    return f"{prefix}{RANK_SUFFIX}"


def is_plain_name(name: str) -> bool:
    """A file name that stays inside its folder."""
    bad = name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name
    return not bad and len(name) <= 255


def bad_names(files: Mapping[str, object]) -> list[str]:
    return [name for name in files if not is_plain_name(name)]


def share_of(names: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The files rank ``rank`` checks at load: every rank a disjoint slice, all of them
    together every file, so verifying costs one read of the step, spread out."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    return sorted(names)[rank::world_size]


def next_candidate(committed: Sequence[int], plain: Sequence[int], below: int | None) -> int:
    """The newest step this rank could load that is older than ``below`` (-1: none).

    Committed steps and plain DCP folders both count; what the ranks then load is the
    minimum over their candidates, so every rank reads the same step.
    """
    pool = [s for s in (*committed, *plain) if below is None or s < below]
    return max(pool, default=-1)


def steps_to_delete(committed: Sequence[int], present: Sequence[int], keep_last: int) -> list[int]:
    """Keep-last rotation: the step folders older than the oldest of the ``keep_last``
    newest committed steps (committed or not: a torn older save is garbage too)."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: expected >= 1")
    newest = sorted(committed, reverse=True)
    if len(newest) <= keep_last:
        return []
    oldest_kept = newest[keep_last - 1]
    return sorted(s for s in present if s < oldest_kept)
