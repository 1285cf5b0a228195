"""Sharded (DCP) steps in the launcher's memory: one rank's shard files and the step's
global metadata per snapshot slot, restored through a DCP storage reader.

Under ``stalwart run --ckpt-ram`` each rank copies, after a DCP save through stalwart
committed, the shard files it wrote (``__<rank>_<i>.distcp``, read back from the page
cache) and DCP's global metadata into the older slot of its segment (``ram``), with a
:class:`ShardSet` index as the slot's head. The launcher's replicas move such a slot like
any other (its record's ``kind`` says what it holds).

At load every rank offers the newest shard set of its own rank and world size that
verifies; only when every rank offers the same step (and it is no older than the newest
step on disk) is it read from memory, with :class:`RamShardReader`: DCP plans and
deserializes as from files, the bytes come from the slot. What a rank needs from
another rank's files (DCP writes each replicated value once, in one rank's file) is
sent by that rank over the process group. Any failure in there fails DCP's read phase
on every rank together, and every rank then loads from disk.

A shard set is only of use at the world size that wrote it: at another one the ranks
offer nothing and load from disk (DCP reshards there). :class:`ShardSet` records the
step, the rank, the world size and every file's extent, which is what a resharding
restore from memory would need to gather.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.futures import Future

from stalwart import runlog

from . import layout
from . import ramlayout as rl
from .dcp_metadata import loads_metadata
from .dcp_records import RankShards, is_plain_name, rank_record_name
from .dcp_storage import read_record, stamp_load_id
from .errors import CheckpointCorruptError, CheckpointError
from .ram import RamSegment, SnapshotTooLargeError, open_local, ram_folder

logger = logging.getLogger(__name__)

SHARD_SET_FORMAT = 1
#: A shard index larger than this is not read (a real one lists a few files).
MAX_INDEX_BYTES = 1 << 20
_SHARD_FILE = re.compile(r"__(\d{1,9})_(\d{1,9})\.distcp")


class ShardFile(msgspec.Struct, frozen=True):
    """One DCP shard file, at ``offset`` of the slot's data region."""

    name: str
    offset: int
    length: int


class ShardSet(msgspec.Struct, frozen=True):
    """What a ``dcp-shards`` slot holds: rank ``rank``'s files of DCP step ``step`` of
    ``root``, saved by ``world_size`` ranks, and the step's global metadata (DCP's
    pickle, read only through the restricted unpickler)."""

    format: int
    root: str
    step: int
    rank: int
    world_size: int
    files: list[ShardFile]
    metadata_offset: int
    metadata_length: int


def shard_owner(name: str) -> int | None:
    """The rank whose files ``name`` is one of (``__<rank>_<i>.distcp``), or None."""
    m = _SHARD_FILE.fullmatch(name)
    return int(m.group(1)) if m else None


def index_problem(index: ShardSet, record: rl.CommitRecord, root: str) -> str:
    """Why ``index`` cannot be the shard set its slot's ``record`` commits, or ''."""
    if index.format != SHARD_SET_FORMAT:
        return f"shard set format {index.format!r}, expected {SHARD_SET_FORMAT}"
    if (index.step, index.rank, index.world_size) != (
        record.step,
        record.rank,
        record.world_size,
    ):
        return "shard set index and slot record disagree on step, rank or world size"
    if index.root != root:
        return f"shard set of {index.root!r}, not of {root!r}"
    extents = [(f.offset, f.length) for f in index.files]
    extents.append((index.metadata_offset, index.metadata_length))
    for offset, length in extents:
        if offset < 0 or length < 0 or offset + length > record.tensor_bytes:
            return f"extent {offset}+{length} outside the {record.tensor_bytes} bytes held"
    for f in index.files:
        if not is_plain_name(f.name) or shard_owner(f.name) != index.rank:
            return f"file {f.name[:80]!r} is not a shard file of rank {index.rank}"
    if len({f.name for f in index.files}) != len(index.files):
        return "a shard file is listed twice"
    return ""


def root_key(root: str | os.PathLike[str]) -> str:
    return os.path.abspath(root)


# -- saving ---------------------------------------------------------------------------


class _LocalSegment:
    """This process's own segment, mapped writable once (saves of several savers share
    it, one at a time)."""

    segment: RamSegment | None = None
    why = ""
    opened = False

    @classmethod
    def get(cls) -> RamSegment | None:
        if not cls.opened:
            cls.opened = True
            cls.segment, cls.why = open_local()
            if cls.segment is None:
                logger.info("sharded snapshots go to disk only: %s", cls.why)
        return cls.segment


def local_segment() -> RamSegment | None:
    """The launcher's segment of this local rank (``--ckpt-ram``), or None."""
    return _LocalSegment.get()


def snapshot_step(
    segment: RamSegment,
    root: str | os.PathLike[str],
    step: int,
    metadata: Metadata,
    rank: int,
    world_size: int,
) -> rl.CommitRecord:
    """Copy this rank's files of committed step ``step`` and its metadata into RAM.

    The files are the ones this rank's record lists (fsync'd, so in the page cache);
    the slot is committed only once every byte is in.
    """
    folder = layout.step_dir(Path(root), step)
    prefix = f"__{rank}_"
    shards = read_record(folder / rank_record_name(prefix), RankShards)
    names = sorted(shards.files)
    meta = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    files: list[ShardFile] = []
    at = 0
    for name in names:
        files.append(ShardFile(name, at, shards.files[name].size))
        at += shards.files[name].size
    index = ShardSet(SHARD_SET_FORMAT, root_key(root), step, rank, world_size, files, at, len(meta))
    head = msgspec.json.encode(index)
    staged, view = segment.stage_raw(head, at + len(meta), step, rank, world_size, rl.KIND_DCP)
    with view:
        for f in files:
            with open(folder / f.name, "rb", buffering=0) as src:
                got = 0
                while got < f.length:
                    n = src.readinto(view[f.offset + got : f.offset + f.length])
                    if not n:
                        raise CheckpointError(
                            f"{folder / f.name}: {got} bytes, its record says {f.length}"
                        )
                    got += n
        view[at : at + len(meta)] = meta
    return segment.commit(staged)


def try_snapshot(
    segment: RamSegment | None,
    root: str | os.PathLike[str],
    step: int,
    metadata: Metadata,
    process_group: Any,
) -> None:
    """:func:`snapshot_step` when there is a segment; a failure only costs the RAM copy
    (the step is durable on disk), so it is logged, not raised."""
    if segment is None:
        return
    rank, world = rank_world(process_group)
    try:
        snapshot_step(segment, root, step, metadata, rank, world)
    except (OSError, CheckpointError, SnapshotTooLargeError) as exc:
        logger.warning("rank %d: step %d not kept in RAM: %s", rank, step, exc)


# -- finding and agreeing ---------------------------------------------------------------


@dataclass(frozen=True)
class HeldShards:
    """A verified shard set in RAM: where it is, what it holds, and the mapping it was
    verified through (kept open, its pages faulted in, so the load reads the bytes
    just hashed instead of mapping and hashing them again; :meth:`close` it)."""

    path: Path
    slot: int
    record: rl.CommitRecord
    index: ShardSet
    segment: RamSegment

    def close(self) -> None:
        self.segment.close()


def find_shards(folder: Path, root: str, rank: int, world_size: int) -> HeldShards | None:
    """The newest shard set of ``rank`` at ``world_size`` for ``root`` that verifies."""
    candidates: list[tuple[Path, int, rl.CommitRecord]] = []
    try:
        paths = sorted(p for p in folder.iterdir() if p.name.endswith(rl.SEGMENT_SUFFIX))
    except OSError:
        return None
    for path in paths:
        with _opened(path) as seg:
            if seg is None:
                continue
            for slot, rec in seg.records():
                if (rec.kind, rec.rank, rec.world_size) == (rl.KIND_DCP, rank, world_size):
                    candidates.append((path, slot, rec))
    candidates.sort(key=lambda c: (c[2].step, c[2].seq), reverse=True)
    for path, slot, rec in candidates:
        seg = _open(path)
        if seg is None:
            continue
        try:
            index = msgspec.json.decode(seg.head(slot, rec, MAX_INDEX_BYTES), type=ShardSet)
            if index.root != root:
                # Another checkpoint folder's shards (a job may save several): not
                # this load's, and nothing wrong with them.
                seg.close()
                continue
            problem = index_problem(index, rec, root)
            if problem:
                raise CheckpointCorruptError(f"{path} slot {slot}: {problem}")
            seg.verify(slot, rec)
        except (OSError, CheckpointError, msgspec.DecodeError) as exc:
            seg.close()
            logger.warning("rank %d: skipping step %d in RAM: %s", rank, rec.step, exc)
            continue
        return HeldShards(path, slot, rec, index, seg)
    return None


def _open(path: Path) -> RamSegment | None:
    try:
        return RamSegment.open(path, writable=False)
    except (OSError, ValueError, CheckpointError) as exc:
        logger.warning("skipping snapshot segment %s: %s", path, exc)
        return None


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[RamSegment | None]:
    try:
        seg = RamSegment.open(path, writable=False)
    except (OSError, ValueError, CheckpointError) as exc:
        logger.warning("skipping snapshot segment %s: %s", path, exc)
        yield None
        return
    try:
        yield seg
    finally:
        seg.close()


def rank_world(group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _all_min(values: list[int], group: Any) -> list[int]:
    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


def ram_choice(mine: int, newest_on_disk: int, lowest: int, highest: int) -> bool:
    """Whether the ranks load from RAM: every rank holds the same step (``lowest`` and
    ``highest`` over the ranks' offers, -1 for none) and it is no older than the newest
    step on disk that every rank sees."""
    return mine >= 0 and lowest == highest == mine and mine >= newest_on_disk


def load_from_ram(
    state_dict: dict[str, Any],
    root: str | os.PathLike[str],
    newest_on_disk: int,
    *,
    process_group: Any = None,
    planner: Any = None,
) -> int | None:
    """Load the step every rank holds in RAM, in place (collective); None: load from disk.

    ``newest_on_disk``: this rank's newest loadable step on disk (-1: none).
    """
    rank, world = rank_world(process_group)
    folder, _ = ram_folder()
    held: HeldShards | None = None
    if folder is not None:
        from .resume import wait_for_fetch

        wait_for_fetch(folder, rank)
        held = find_shards(folder, root_key(root), rank, world)
    try:
        return _load_held(state_dict, held, newest_on_disk, process_group, planner)
    finally:
        if held is not None:
            held.close()


def _load_held(
    state_dict: dict[str, Any],
    held: HeldShards | None,
    newest_on_disk: int,
    process_group: Any,
    planner: Any,
) -> int | None:
    rank, _ = rank_world(process_group)
    mine = held.record.step if held is not None else -1
    lowest, neg_highest, disk = _all_min([mine, -mine, newest_on_disk], process_group)
    if not ram_choice(mine, disk, lowest, -neg_highest):
        if mine >= 0 or lowest >= 0:
            logger.info(
                "rank %d: RAM holds step %d here, %d..%d over the ranks (disk: %d): "
                "loading from disk",
                rank,
                mine,
                lowest,
                -neg_highest,
                disk,
            )
        return None
    assert held is not None
    try:
        reader = RamShardReader.open(held, process_group)
    except (OSError, CheckpointError) as exc:
        logger.warning("rank %d: step %d in RAM unreadable: %s", rank, mine, exc)
        reader = RamShardReader.broken(held, process_group, str(exc))
    try:
        dcp_load(state_dict, storage_reader=reader, planner=planner, process_group=process_group)
    except CheckpointException as exc:
        # DCP raises on every rank when any rank's read failed: all go to disk together.
        logger.warning("step %d from RAM failed, loading from disk: %s", mine, _first(exc))
        return None
    finally:
        reader.release()
    logger.info("rank %d resumes from step %d (ram, %s)", rank, mine, held.path)
    runlog.emit(runlog.CHECKPOINT_RESTORED, step=mine, source="ram", path=str(held.path))
    return mine


def _first(exc: CheckpointException) -> str:
    for failed, _ in exc.failures.values():
        return str(failed)
    return str(exc)


# -- reading ----------------------------------------------------------------------------


class _NoFiles(FileSystem):
    """DCP's reader opens each file before slicing it; here nothing is on disk."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        yield io.BytesIO()


class _ViewReader(io.RawIOBase):
    """A read-only file over a slice of the mapped slot: DCP's ``torch.load`` of one
    item reads its bytes straight out of the segment, with no copy in between."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError(f"seek to {base + offset}: before the start")
        self._at = base + offset
        return self._at

    def readinto(self, buffer: Any) -> int:
        with memoryview(buffer) as out:
            n = max(0, min(out.nbytes, len(self._view) - self._at))
            out.cast("B")[:n] = self._view[self._at : self._at + n]
        self._at += n
        return n

    def close(self) -> None:
        self._view.release()
        super().close()


class RamShardReader(FileSystemReader):
    """A DCP storage reader over one rank's shard set in RAM, read in place from the
    mapping it was verified through (``held.segment``).

    ``read_data`` first fetches, from the ranks that hold them, the extents of other
    ranks' files this rank's plan needs (collective: every rank calls it once per load),
    and afterwards checks that the slot was not reused while it was read.
    """

    def __init__(
        self,
        held: HeldShards,
        files: dict[str, memoryview],
        metadata: Metadata | None,
        process_group: Any,
        problem: str = "",
    ) -> None:
        super().__init__(f"ram-step-{held.index.step}")
        self.fs = _NoFiles()
        self.held = held
        self._files = files
        self._metadata = metadata
        self._group = process_group
        self._problem = problem
        self._fetched: dict[tuple[str, int, int], bytes] = {}

    @classmethod
    def open(cls, held: HeldShards, process_group: Any) -> RamShardReader:
        """Views of the shard set's files in its slot, and its metadata (unpickled
        through the restricted unpickler); ``held`` was verified when found."""
        body = held.segment.body(held.slot, held.record)
        files = {f.name: body[f.offset : f.offset + f.length] for f in held.index.files}
        at = held.index.metadata_offset
        meta = bytes(body[at : at + held.index.metadata_length])
        body.release()
        try:
            metadata = loads_metadata(meta, f"{held.path} slot {held.slot} (metadata)")
        except BaseException:
            for view in files.values():
                view.release()
            raise
        return cls(held, files, metadata, process_group)

    @classmethod
    def broken(cls, held: HeldShards, process_group: Any, problem: str) -> RamShardReader:
        """A reader that takes part in the collectives and then fails the read, so the
        other ranks learn of this rank's failure instead of waiting on it."""
        return cls(held, {}, None, process_group, problem)

    def release(self) -> None:
        """Let go of the views into the slot (before its segment is closed)."""
        for view in self._files.values():
            view.release()
        self._files = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            raise CheckpointCorruptError(self._problem)
        return stamp_load_id(self._metadata, self.load_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        wanted: list[_StorageInfo] = []
        for item in plan.items:
            info: _StorageInfo = self.storage_data[item.storage_index]
            if info.relative_path not in self._files:
                wanted.append(info)
        self._fetched = exchange_extents(wanted, self._files, self._group)
        done = super().read_data(plan, planner)
        # Read in place: a save into this slot meanwhile (it invalidates the record
        # first) would have torn what was read; DCP then fails the load on every rank.
        if self.held.segment.record(self.held.slot) != self.held.record:
            raise CheckpointCorruptError(
                f"{self.held.path} slot {self.held.slot}: overwritten while read"
            )
        return done

    def _slice_file(self, file: Any, sinfo: _StorageInfo) -> IO[bytes]:
        own = self._files.get(sinfo.relative_path)
        if own is not None:
            if sinfo.offset < 0 or sinfo.length < 0 or sinfo.offset + sinfo.length > len(own):
                raise CheckpointCorruptError(
                    f"{sinfo.relative_path}: extent {sinfo.offset}+{sinfo.length} "
                    f"outside its {len(own)} bytes"
                )
            return cast(IO[bytes], _ViewReader(own[sinfo.offset : sinfo.offset + sinfo.length]))
        got = self._fetched.get((sinfo.relative_path, sinfo.offset, sinfo.length))
        if got is None:
            raise CheckpointCorruptError(f"{sinfo.relative_path}: not held in RAM by any rank")
        return io.BytesIO(got)


#: Columns of one extent request: owner rank, index in the owner's file list, offset, length.
_REQUEST_COLS = 4


def exchange_extents(
    wanted: list[_StorageInfo], files: Mapping[str, bytes | memoryview], group: Any
) -> dict[tuple[str, int, int], bytes]:
    """Every rank's ``wanted`` extents of other ranks' files, from those ranks.

    Collective. Requests travel as int64 tensors; the owners check them against their
    files before anything is sent, and any bad request fails the exchange on every rank
    (CheckpointCorruptError), so a hostile index cannot make a rank allocate or send
    more than the files hold.
    """
    rank, world = rank_world(group)
    problem = ""
    rows: list[list[int]] = []
    for info in wanted:
        owner = shard_owner(info.relative_path)
        file_no = _file_number(info.relative_path)
        if owner is None or file_no is None or not 0 <= owner < world or owner == rank:
            problem = f"{info.relative_path[:80]!r}: no rank holds it"
            continue
        rows.append([owner, file_no, info.offset, info.length])
    if world == 1:
        if problem or rows:
            raise CheckpointCorruptError(problem or "extents of other ranks' files wanted")
        return {}
    count = torch.tensor([len(rows)], dtype=torch.int64)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    width = max(int(c.item()) for c in counts)
    requests: list[list[list[int]]] = [[] for _ in range(world)]
    if width:
        mine = torch.full((width, _REQUEST_COLS), -1, dtype=torch.int64)
        if rows:
            mine[: len(rows)] = torch.tensor(rows, dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        for r, (t, c) in enumerate(zip(gathered, counts, strict=True)):
            requests[r] = t[: int(c.item())].tolist()
    own_by_number = {_file_number(name): data for name, data in files.items()}
    for req_rows in requests:
        for owner, file_no, offset, length in req_rows:
            if owner != rank:
                continue
            data = own_by_number.get(file_no)
            if data is None or offset < 0 or length < 0 or offset + length > len(data):
                problem = problem or f"a rank asked for {offset}+{length} of file {file_no}"
    (bad,) = _all_min([0 if not problem else -1], group)
    if bad < 0:
        raise CheckpointCorruptError(problem or "another rank's RAM shard set is unusable")
    out: dict[tuple[str, int, int], bytes] = {}
    for src in range(world):
        pieces = [
            (r, row) for r, req_rows in enumerate(requests) for row in req_rows if row[0] == src
        ]
        total = sum(row[3] for _, row in pieces)
        if not total:
            continue
        if src == rank:
            payload = bytearray(total)
            at = 0
            for _, (_, file_no, offset, length) in pieces:
                payload[at : at + length] = own_by_number[file_no][offset : offset + length]
                at += length
            buf = torch.frombuffer(payload, dtype=torch.uint8)
        else:
            buf = torch.empty(total, dtype=torch.uint8)
        dist.broadcast(buf, group=group, group_src=src)
        if not any(r == rank for r, _ in pieces):
            continue
        raw = buf.numpy().tobytes()
        at = 0
        for r, (_, file_no, offset, length) in pieces:
            if r == rank:
                out[(f"__{src}_{file_no}.distcp", offset, length)] = raw[at : at + length]
            at += length
    return out


def _file_number(name: str) -> int | None:
    m = _SHARD_FILE.fullmatch(name)
    return int(m.group(2)) if m else None
