"""Sharded (DCP) steps in the launcher's memory: one rank's shard files and the step's
global metadata per snapshot slot, restored through a DCP storage reader.

Under ``stalwart run --ckpt-ram`` every rank of a save through
:class:`~stalwart.checkpoint.dcp_storage.DcpWriter` copies the shard files it wrote
(``__<rank>_<i>.distcp``, read back from the page cache) into the older slot of its
segment (``ram``), with a :class:`ShardSet` index as the slot's head: the other ranks as
soon as their files are durable, the coordinator after the commit, with DCP's global
metadata. Its set is what vouches for the step: every set of one save carries the save's
token, and a step counts in RAM only when the coordinator's set of that token is there.
The launcher's replicas move such a slot like any other (its record's ``kind`` says what
it holds).

At load every rank offers what its node's segments hold for the job's root (its own
slots, its node's other ranks' slots, replicas of peers): step, saving world size and
saving rank of each shard set whose index checks out, as a bounded :class:`RamOffer`.
From the gathered offers every rank computes the same :class:`RamPlan`
(:func:`plan_ram_load`): the newest step whose every saving rank's shard set some rank
holds, no older than the newest step on disk, and which rank serves which saving rank's
files. Only a set's server hashes its data (once); a set that does not verify is
dropped and the ranks plan again without it. The plan may be at
another world size than the one loading: DCP plans the resharding from the step's
metadata as it would from files, each rank reads the files it serves out of its slots,
and the extents of other files its plan needs are sent by their serving rank over the
process group. When no step qualifies, or any rank cannot read what it serves, every
rank loads from disk together.
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
from typing import Any

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
from stalwart.base.pgdevice import group_device

from . import layout
from . import ramlayout as rl
from .dcp_items import read_items
from .dcp_metadata import loads_metadata
from .dcp_records import MAX_SAVE_TOKEN, is_plain_name
from .dcp_storage import stamp_load_id
from .errors import CheckpointCorruptError, CheckpointError
from .manifest import FileEntry
from .ram import RamSegment, SnapshotTooLargeError, open_local, ram_folder
from .ramshared import SEGMENTS, segment_paths

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
    ``root``, saved by ``world_size`` ranks in the save ``save``, and (saving rank 0, the
    coordinator, only) the step's global metadata (DCP's pickle, read only through the
    restricted unpickler)."""

    format: int
    root: str
    step: int
    rank: int
    world_size: int
    files: list[ShardFile]
    metadata_offset: int
    metadata_length: int
    save: str = ""


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
    if len(index.save) > MAX_SAVE_TOKEN:
        return f"save token of {len(index.save)} characters, expected at most {MAX_SAVE_TOKEN}"
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
    shards: Mapping[str, FileEntry],
    metadata: Metadata | None,
    rank: int,
    world_size: int,
    save: str,
) -> rl.CommitRecord:
    """Copy this rank's ``shards`` of step ``step`` (durable, so in the page cache) and,
    for the coordinator, the step's ``metadata`` into RAM.

    The slot is committed only once every byte is in.
    """
    folder = layout.step_dir(Path(root), step)
    meta = b"" if metadata is None else pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    files: list[ShardFile] = []
    at = 0
    for name in sorted(shards):
        files.append(ShardFile(name, at, shards[name].size))
        at += shards[name].size
    index = ShardSet(
        SHARD_SET_FORMAT, root_key(root), step, rank, world_size, files, at, len(meta), save
    )
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
    segment: RamSegment,
    root: str | os.PathLike[str],
    step: int,
    shards: Mapping[str, FileEntry],
    metadata: Metadata | None,
    rank: int,
    world_size: int,
    save: str,
) -> None:
    """:func:`snapshot_step`; a failure only costs the RAM copy (the files are durable
    on disk), so it is logged, not raised."""
    try:
        snapshot_step(segment, root, step, shards, metadata, rank, world_size, save)
    except (OSError, CheckpointError, SnapshotTooLargeError) as exc:
        logger.warning("rank %d: step %d not kept in RAM: %s", rank, step, exc)


# -- finding and agreeing ---------------------------------------------------------------

#: Bounds of one rank's offer: a real one lists a few shard sets.
OFFER_FORMAT = 1
MAX_OFFER_BYTES = 16 << 10
MAX_HELD = 64
MAX_WORLD = 1 << 20
#: Slots looked at in a node's segments (two per local rank, and replicas of peers).
MAX_COPIES = 4 * MAX_HELD
#: Rounds of offering, planning and verifying before the ranks give up on RAM: each
#: round after the first follows a served set that did not verify.
MAX_ROUNDS = 8


@dataclass(frozen=True)
class HeldShards:
    """A shard set in RAM whose index checked out: where it is, what it holds, and the
    mapping to read it through (the process's own, kept: see ``ramshared``). Its data
    is hashed only by the rank that serves it (:meth:`verify`), once per commit record
    and process, whose reads then use the pages just hashed."""

    path: Path
    slot: int
    record: rl.CommitRecord
    index: ShardSet
    segment: RamSegment

    @property
    def key(self) -> HeldSet:
        return HeldSet(self.index.step, self.index.world_size, self.index.rank, self.index.save)

    def verify(self) -> None:
        """Check the data's checksum (CheckpointCorruptError when torn)."""
        self.segment.verify(self.slot, self.record)


def find_all_shards(
    folder: Path, root: str, *, step: int | None = None, ranks: set[int] | None = None
) -> list[HeldShards]:
    """Every shard set of ``root`` in ``folder``'s segments whose index checks out,
    newest step first, only of ``step`` and of saving ``ranks`` when given (copies of one
    set, e.g. a node's own and a replica, each listed; their data is not hashed here: see
    :func:`first_verified`), read through the process's mappings (``ramshared``)."""
    candidates: list[tuple[Path, RamSegment, int, rl.CommitRecord]] = []
    SEGMENTS.prune()
    for path in segment_paths(folder):
        seg = SEGMENTS.get(path)
        if seg is None:
            continue
        for slot, rec in seg.records():
            if (
                rec.kind == rl.KIND_DCP
                and (step is None or rec.step == step)
                and (ranks is None or rec.rank in ranks)
            ):
                candidates.append((path, seg, slot, rec))
    candidates.sort(key=lambda c: (c[3].step, c[3].world_size, -c[3].rank, c[3].seq), reverse=True)
    found: list[HeldShards] = []
    for path, seg, slot, rec in candidates[:MAX_COPIES]:
        try:
            index = msgspec.json.decode(seg.head(slot, rec, MAX_INDEX_BYTES), type=ShardSet)
            if index.root != root:
                # Another checkpoint folder's shards (a job may save several): not
                # this load's, and nothing wrong with them.
                continue
            problem = index_problem(index, rec, root)
            if problem:
                raise CheckpointCorruptError(f"{path} slot {slot}: {problem}")
        except (OSError, CheckpointError, msgspec.DecodeError) as exc:
            logger.warning("skipping step %d of rank %d in RAM: %s", rec.step, rec.rank, exc)
            continue
        found.append(HeldShards(path, slot, rec, index, seg))
    return found


class HeldSet(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One shard set a rank can serve: saving rank ``rank`` of ``world_size``, ``step``,
    of the save ``save``."""

    step: int
    world_size: int
    rank: int
    save: str = ""


class RamOffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one loading rank offers: the shard sets its node holds, and the newest step
    it finds on disk (-1: none)."""

    format: int
    rank: int
    newest_on_disk: int
    held: list[HeldSet]


def read_offer(raw: bytes, sender: int, world_size: int) -> RamOffer:
    """The offer rank ``sender`` of ``world_size`` sent, checked (CheckpointCorruptError)."""
    if len(raw) > MAX_OFFER_BYTES:
        raise CheckpointCorruptError(
            f"rank {sender}'s RAM offer is {len(raw)} bytes, expected at most {MAX_OFFER_BYTES}"
        )
    try:
        offer = msgspec.json.decode(raw, type=RamOffer)
    except msgspec.DecodeError as exc:
        raise CheckpointCorruptError(f"rank {sender}'s RAM offer: {exc}") from None
    problem = ""
    if offer.format != OFFER_FORMAT:
        problem = f"format {offer.format!r}, expected {OFFER_FORMAT}"
    elif offer.rank != sender:
        problem = f"it says it is rank {offer.rank}"
    elif offer.newest_on_disk < -1:
        problem = f"newest step on disk {offer.newest_on_disk}, expected -1 or more"
    elif len(offer.held) > MAX_HELD:
        problem = f"{len(offer.held)} shard sets, expected at most {MAX_HELD}"
    elif len(set(offer.held)) != len(offer.held):
        problem = "a shard set is listed twice"
    else:
        for h in offer.held:
            if len(h.save) > MAX_SAVE_TOKEN:
                problem = f"a save token of {len(h.save)} characters"
                break
            if h.step < 0 or not 0 <= h.rank < h.world_size <= MAX_WORLD:
                problem = (
                    f"shard set step {h.step} rank {h.rank} of {h.world_size}: expected "
                    f"step >= 0 and 0 <= rank < world size <= {MAX_WORLD}"
                )
                break
    if problem or not 0 <= sender < world_size:
        raise CheckpointCorruptError(f"rank {sender}'s RAM offer refused: {problem}")
    return offer


@dataclass(frozen=True)
class RamPlan:
    """Load ``step`` (saved by ``saved_world`` ranks in the save ``save``) from RAM;
    saving rank ``s``'s files are served by loading rank ``servers[s]``."""

    step: int
    saved_world: int
    servers: tuple[int, ...]
    save: str = ""


def plan_ram_load(offers: list[RamOffer | None]) -> tuple[RamPlan | None, str]:
    """Which step the ranks load from RAM and who serves which files; None and why: disk.

    ``offers``: every loading rank's offer in rank order, None where it was refused. Pure:
    every rank computes it over the same gathered offers and gets the same answer.
    """
    if not offers:
        return None, "no ranks"
    refused = [r for r, o in enumerate(offers) if o is None]
    if refused:
        return None, f"the RAM offer of rank {refused[0]} was refused"
    valid = [o for o in offers if o is not None]
    disk = min(o.newest_on_disk for o in valid)
    holders: dict[tuple[int, int, str], dict[int, list[int]]] = {}
    for r, o in enumerate(valid):
        for h in o.held:
            key = (h.step, h.world_size, h.save)
            holders.setdefault(key, {}).setdefault(h.rank, []).append(r)
    if not holders:
        return None, "no rank holds a shard set in RAM"
    why = f"no step in RAM is whole and as new as the newest on disk ({disk})"
    for step, saved_world, save in sorted(holders, reverse=True):
        if step < disk:
            break
        # Sets of one save only (its token): another save of the step, or one whose
        # commit never came, is not mixed in.
        by_rank = holders[(step, saved_world, save)]
        if len(by_rank) != saved_world:
            continue
        load = [0] * len(valid)
        servers: list[int] = []
        for saved in range(saved_world):
            held_by = by_rank[saved]
            # A rank serves its own saving rank's files where it can (nothing crosses
            # the group when the world is unchanged); else the least loaded holder.
            server = saved if saved in held_by else min(held_by, key=lambda r: (load[r], r))
            load[server] += 1
            servers.append(server)
        return RamPlan(step, saved_world, tuple(servers), save), ""
    return None, why


def offer_of(rank: int, held: list[HeldShards], newest_on_disk: int) -> RamOffer:
    """This rank's offer: its newest ``MAX_HELD`` shard sets (``held`` is newest first;
    copies of one set are offered once)."""
    sets: list[HeldSet] = []
    for h in held:
        if h.key not in sets:
            sets.append(h.key)
    return RamOffer(OFFER_FORMAT, rank, newest_on_disk, sets[:MAX_HELD])


def rank_world(group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _all_min(values: list[int], group: Any) -> list[int]:
    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.int64, device=group_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


def gather_offers(mine: bytes, group: Any) -> list[RamOffer | None]:
    """Every rank's offer (collective); one longer than ``MAX_OFFER_BYTES`` is refused
    before anything of its size is allocated."""
    _, world = rank_world(group)
    if world == 1:
        return [_checked(mine, 0, 1)]
    dev = group_device(group)
    length = torch.tensor([len(mine)], dtype=torch.int64, device=dev)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(t.item()) for t in lengths]
    width = min(max(sizes), MAX_OFFER_BYTES)
    buf = torch.zeros(width, dtype=torch.uint8)
    if len(mine) <= width:
        buf[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    buf = buf.to(dev)
    gathered = [torch.empty_like(buf) for _ in range(world)]
    if width:
        dist.all_gather(gathered, buf, group=group)
    out: list[RamOffer | None] = []
    for r, (t, n) in enumerate(zip(gathered, sizes, strict=True)):
        raw = t.cpu().numpy().tobytes()[:n] if 0 <= n <= width else b"x" * (MAX_OFFER_BYTES + 1)
        out.append(_checked(raw, r, world))
    return out


def _checked(raw: bytes, sender: int, world: int) -> RamOffer | None:
    try:
        return read_offer(raw, sender, world)
    except CheckpointCorruptError as exc:
        logger.warning("%s", exc)
        return None


def _broadcast_bytes(data: bytes | None, src: int, group: Any) -> bytes:
    """``data`` of rank ``src`` on every rank (collective; a world of one returns it)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return data or b""
    dev = group_device(group)
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=dev)
    dist.broadcast(length, group=group, group_src=src)
    n = int(length.item())
    if data is not None:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    if n:
        buf = buf.to(dev)
        dist.broadcast(buf, group=group, group_src=src)
    return buf.cpu().numpy().tobytes() if n else b""


def load_from_ram(
    state_dict: dict[str, Any],
    root: str | os.PathLike[str],
    newest_on_disk: int,
    *,
    process_group: Any = None,
    planner: Any = None,
) -> int | None:
    """Load the newest step the ranks hold whole in RAM, in place (collective); None:
    load from disk.

    ``newest_on_disk``: this rank's newest loadable step on disk (-1: none).
    """
    rank, _ = rank_world(process_group)
    folder, _ = ram_folder()
    found: list[HeldShards] = []
    if folder is not None:
        from .resume import wait_for_fetch

        wait_for_fetch(folder, rank)
        found = find_all_shards(folder, root_key(root))
    return _load_held(state_dict, found, newest_on_disk, process_group, planner)


def _load_held(
    state_dict: dict[str, Any],
    held: list[HeldShards],
    newest_on_disk: int,
    process_group: Any,
    planner: Any,
) -> int | None:
    rank, _ = rank_world(process_group)
    usable = list(held)
    for _ in range(MAX_ROUNDS):
        offer = msgspec.json.encode(offer_of(rank, usable, newest_on_disk))
        plan, why = plan_ram_load(gather_offers(offer, process_group))
        if plan is None:
            if held:
                logger.info("rank %d: loading from disk: %s", rank, why)
            return None
        serving, problem = _verified_serving(plan, rank, usable)
        (ok,) = _all_min([0 if problem else 1], process_group)
        if ok:
            break
        # A set this rank serves did not verify (it is out of ``usable`` now), or
        # another rank's did: offer again, without it.
    else:
        logger.info("rank %d: loading from disk: no shard set in RAM verified", rank)
        return None
    files: dict[str, memoryview] = {}
    meta: bytes | None = None
    problem = ""
    try:
        for h in serving:
            got, held_meta = shard_views(h)
            files.update(got)
            if h.index.rank == 0:
                # The coordinator's set holds the step's metadata; the others' none.
                meta = held_meta
    except (OSError, CheckpointError, ValueError) as exc:
        problem = str(exc)
        logger.warning("rank %d: step %d in RAM unreadable: %s", rank, plan.step, exc)
    reader = RamShardReader(plan, serving, files, process_group)
    try:
        (ok,) = _all_min([0 if problem else 1], process_group)
        if not ok:
            return None
        # Every rank plans from the same metadata: the copy of saving rank 0's server.
        raw_meta = _broadcast_bytes(meta, plan.servers[0], process_group)
        try:
            reader.metadata = loads_metadata(raw_meta, f"step {plan.step} in RAM (metadata)")
        except CheckpointError as exc:
            # The same bytes on every rank: every rank fails here together.
            logger.warning("rank %d: step %d in RAM: %s", rank, plan.step, exc)
            return None
        try:
            dcp_load(
                state_dict, storage_reader=reader, planner=planner, process_group=process_group
            )
        except CheckpointException as exc:
            # DCP raises on every rank when any rank's read failed: all go to disk together.
            logger.warning("step %d from RAM failed, loading from disk: %s", plan.step, _first(exc))
            return None
    finally:
        reader.release()
    where = ",".join(sorted({str(h.path) for h in serving})) or "peers"
    logger.info(
        "rank %d resumes from step %d (ram, saved by %d ranks, %s)",
        rank,
        plan.step,
        plan.saved_world,
        where,
    )
    runlog.emit(runlog.CHECKPOINT_RESTORED, step=plan.step, source="ram", path=where)
    return plan.step


def _verified_serving(
    plan: RamPlan, rank: int, usable: list[HeldShards]
) -> tuple[list[HeldShards], str]:
    """The shard sets this rank serves under ``plan``, each the first copy whose data
    verifies; copies that do not are dropped from ``usable``. '' or why one is missing."""
    serving: list[HeldShards] = []
    for saved, server in enumerate(plan.servers):
        if server != rank:
            continue
        want = HeldSet(plan.step, plan.saved_world, saved, plan.save)
        good = first_verified(usable, want, rank)
        if good is None:
            return [], f"no copy of step {plan.step}'s rank {saved} shards verifies"
        serving.append(good)
    return serving, ""


def first_verified(usable: list[HeldShards], want: HeldSet, rank: int) -> HeldShards | None:
    """The first copy of shard set ``want`` in ``usable`` whose data verifies; the copies
    tried before it that do not are dropped from ``usable``."""
    for h in [h for h in usable if h.key == want]:
        try:
            h.verify()
        except (OSError, CheckpointError) as exc:
            logger.warning(
                "rank %d: step %d of rank %d in RAM: %s", rank, want.step, want.rank, exc
            )
            usable.remove(h)
            continue
        return h
    return None


def _first(exc: CheckpointException) -> str:
    for failed, _ in exc.failures.values():
        return str(failed)
    return str(exc)


# -- reading ----------------------------------------------------------------------------


def shard_views(held: HeldShards) -> tuple[dict[str, memoryview], bytes]:
    """Views of a shard set's files in its slot, read through the mapping it was
    verified through (no second hash, no copy), and its metadata's bytes;
    :meth:`RamShardReader.release` the views before ``held`` is closed."""
    with held.segment.body(held.slot, held.record) as body:
        files = {f.name: body[f.offset : f.offset + f.length] for f in held.index.files}
        at = held.index.metadata_offset
        meta = bytes(body[at : at + held.index.metadata_length])
    return files, meta


class NoFiles(FileSystem):
    """DCP's reader opens each file before slicing it; here nothing is on disk."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        yield io.BytesIO()


def extent(files: Mapping[str, memoryview], sinfo: _StorageInfo) -> memoryview:
    """The extent ``sinfo`` of a file held in RAM: a view into its slot."""
    own = files.get(sinfo.relative_path)
    if own is None:
        raise CheckpointCorruptError(f"{sinfo.relative_path}: not held in RAM")
    if sinfo.offset < 0 or sinfo.length < 0 or sinfo.offset + sinfo.length > len(own):
        raise CheckpointCorruptError(
            f"{sinfo.relative_path}: extent {sinfo.offset}+{sinfo.length} "
            f"outside its {len(own)} bytes"
        )
    return own[sinfo.offset : sinfo.offset + sinfo.length]


class RamShardReader(FileSystemReader):
    """A DCP storage reader over the shard files this rank serves under ``plan``, read
    in place from the mappings they were verified through (``serving``' segments).

    ``read_data`` first fetches, from their serving ranks, the extents of other files
    this rank's plan needs (collective: every rank calls it once per load), and
    afterwards checks that no served slot was reused while it was read.
    """

    def __init__(
        self,
        plan: RamPlan,
        serving: list[HeldShards],
        files: dict[str, memoryview],
        process_group: Any,
    ) -> None:
        super().__init__(f"ram-step-{plan.step}")
        self.fs = NoFiles()
        self.plan = plan
        self.serving = serving
        #: Set (from the broadcast copy every rank shares) before DCP reads it.
        self.metadata: Metadata | None = None
        self._files = files
        self._group = process_group
        self._fetched: dict[tuple[str, int, int], bytes] = {}

    def release(self) -> None:
        """Let go of the views into the slots (before their segments are closed)."""
        for view in self._files.values():
            view.release()
        self._files = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata is None:
            raise CheckpointCorruptError(f"step {self.plan.step} in RAM: no metadata")
        return stamp_load_id(self.metadata, self.load_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        wanted: list[_StorageInfo] = []
        for item in plan.items:
            info: _StorageInfo = self.storage_data[item.storage_index]
            if info.relative_path not in self._files:
                wanted.append(info)
        self._fetched = exchange_extents(wanted, self._files, self.plan.servers, self._group)
        read_items(self, plan, planner, self._blob)
        # Read in place: a save into a served slot meanwhile (it invalidates the record
        # first) would have torn what was read; DCP then fails the load on every rank.
        for h in self.serving:
            if h.segment.record(h.slot) != h.record:
                raise CheckpointCorruptError(f"{h.path} slot {h.slot}: overwritten while read")
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _blob(self, sinfo: _StorageInfo) -> memoryview:
        """The bytes of one item: a view into a served slot, or what its server sent."""
        if sinfo.relative_path in self._files:
            return extent(self._files, sinfo)
        got = self._fetched.get((sinfo.relative_path, sinfo.offset, sinfo.length))
        if got is None:
            raise CheckpointCorruptError(f"{sinfo.relative_path}: not held in RAM by any rank")
        return memoryview(got)


#: Columns of one extent request: serving rank, saving rank, file number, offset, length.
_REQUEST_COLS = 5


def exchange_extents(
    wanted: list[_StorageInfo],
    files: Mapping[str, bytes | memoryview],
    servers: tuple[int, ...],
    group: Any,
) -> dict[tuple[str, int, int], bytes]:
    """Every rank's ``wanted`` extents of files it does not serve, from their servers
    (``servers[s]``: the rank serving saving rank ``s``'s files).

    Collective. Requests travel as int64 tensors; the servers check them against their
    files before anything is sent, and any bad request fails the exchange on every rank
    (CheckpointCorruptError), so a hostile index cannot make a rank allocate or send
    more than the files hold.
    """
    rank, world = rank_world(group)
    problem = ""
    rows: list[list[int]] = []
    for info in wanted:
        saved = shard_owner(info.relative_path)
        file_no = _file_number(info.relative_path)
        server = servers[saved] if saved is not None and 0 <= saved < len(servers) else -1
        if file_no is None or saved is None or not 0 <= server < world or server == rank:
            problem = f"{info.relative_path[:80]!r}: no rank holds it"
            continue
        rows.append([server, saved, file_no, info.offset, info.length])
    if world == 1:
        if problem or rows:
            raise CheckpointCorruptError(problem or "extents of other ranks' files wanted")
        return {}
    dev = group_device(group)
    count = torch.tensor([len(rows)], dtype=torch.int64, device=dev)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    width = max(int(c.item()) for c in counts)
    requests: list[list[list[int]]] = [[] for _ in range(world)]
    if width:
        mine = torch.full((width, _REQUEST_COLS), -1, dtype=torch.int64)
        if rows:
            mine[: len(rows)] = torch.tensor(rows, dtype=torch.int64)
        mine = mine.to(dev)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        for r, (t, c) in enumerate(zip(gathered, counts, strict=True)):
            requests[r] = t[: int(c.item())].cpu().tolist()
    for req_rows in requests:
        for server, saved, file_no, offset, length in req_rows:
            if server != rank:
                continue
            data = files.get(f"__{saved}_{file_no}.distcp")
            if data is None or offset < 0 or length < 0 or offset + length > len(data):
                problem = problem or f"a rank asked for {offset}+{length} of __{saved}_{file_no}"
    (bad,) = _all_min([0 if not problem else -1], group)
    if bad < 0:
        raise CheckpointCorruptError(problem or "another rank's RAM shard set is unusable")
    out: dict[tuple[str, int, int], bytes] = {}
    for src in range(world):
        pieces = [
            (r, row) for r, req_rows in enumerate(requests) for row in req_rows if row[0] == src
        ]
        total = sum(row[4] for _, row in pieces)
        if not total:
            continue
        if src == rank:
            payload = bytearray(total)
            at = 0
            for _, (_, saved, file_no, offset, length) in pieces:
                data = files[f"__{saved}_{file_no}.distcp"]
                payload[at : at + length] = data[offset : offset + length]
                at += length
            buf = torch.frombuffer(payload, dtype=torch.uint8).to(dev)
        else:
            buf = torch.empty(total, dtype=torch.uint8, device=dev)
        dist.broadcast(buf, group=group, group_src=src)
        if not any(r == rank for r, _ in pieces):
            continue
        raw = buf.cpu().numpy().tobytes()
        at = 0
        for r, (_, saved, file_no, offset, length) in pieces:
            if r == rank:
                out[(f"__{saved}_{file_no}.distcp", offset, length)] = raw[at : at + length]
            at += length
    return out


def _file_number(name: str) -> int | None:
    m = _SHARD_FILE.fullmatch(name)
    return int(m.group(2)) if m else None
