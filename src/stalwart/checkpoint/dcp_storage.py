"""stalwart's guarantees behind DCP's own storage interfaces.

:class:`DcpWriter` is a ``FileSystemWriter`` (so ``dcp.save``/``dcp.async_save``
take it as ``storage_writer=``) that checksums every shard while DCP writes it,
fsyncs it (including the bytes DCP's buffered stream still held when DCP called
fsync), records each rank's files, and has the coordinator write the commit
record after DCP's metadata: a step is complete only once every rank's shards
and the metadata are durable. It then moves ``latest`` and applies keep-last.

:class:`DcpReader` is a ``FileSystemReader`` whose metadata goes through the
restricted unpickler and whose shards are checked against the commit record
before DCP reads them. Both write and read plain DCP folders: ``dcp.load``
reads what :class:`DcpWriter` wrote, and :class:`DcpReader` reads plain saves.

Under ``stalwart run --ckpt-ram`` the writer also keeps every rank's shards in the
launcher's memory (see :mod:`~stalwart.checkpoint.dcp_ram`), and the reader takes them
from there when every rank holds its share of that very save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
    SerializationFormat,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from stalwart import runlog

from . import layout, manifest
from .dcp_metadata import read_metadata
from .dcp_records import (
    COMMIT_NAME,
    FORMAT_VERSION,
    MAX_RECORD_BYTES,
    METADATA_NAME,
    DcpCommit,
    RankShards,
    bad_names,
    rank_record_name,
    steps_to_delete,
)
from .dcp_shard_writer import HashingFile
from .errors import CheckpointCorruptError, CheckpointError, WriterDiedError, WriterError
from .fsio import fsync_dir, remove_tree, replace_symlink, write_file_durably
from .manifest import DEFAULT_ALGORITHM, FileEntry, file_checksum, new_hasher

if TYPE_CHECKING:
    from .dcp_ramsource import RamSource
    from .dcp_shards import ShardProcess
    from .ram import RamSegment

logger = logging.getLogger(__name__)
_T = TypeVar("_T")
_R = TypeVar("_R", RankShards, DcpCommit)


class DcpWriteError(CheckpointError):
    """A DCP save through stalwart failed; the previous steps are untouched.

    ``errno`` is the failing ``OSError``'s (e.g. ``errno.ENOSPC``), else None.
    """

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


@dataclasses.dataclass
class SavePrefix(_StoragePrefix):
    """What DCP's coordinator hands each rank for one save: its file prefix, the save's
    token and the saving world size (for the RAM copies of its shards)."""

    save: str = ""
    world_size: int = 0
    rank: int = 0


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording size and checksum of every file it writes."""

    def __init__(self, algorithm: str) -> None:
        super().__init__()
        self.algorithm = algorithm
        self._lock = threading.Lock()
        self._written: dict[str, FileEntry] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        p = Path(path)
        raw = HashingFile(p, new_hasher(self.algorithm))
        stream = io.BufferedWriter(raw, buffer_size=1 << 20)
        try:
            yield stream
            if not raw.closed:
                # DCP fsyncs the descriptor before closing its buffered stream: the
                # bytes still in the buffer reach the disk only here.
                stream.flush()
                os.fsync(raw.fileno())
        finally:
            stream.close()
        if raw.in_order:
            entry = FileEntry(raw.size, raw.digest(), self.algorithm)
        else:
            size, digest = file_checksum(p, self.algorithm)
            entry = FileEntry(size, digest, self.algorithm)
        with self._lock:
            self._written[p.name] = entry

    def take(self, names: Iterable[str]) -> dict[str, FileEntry]:
        with self._lock:
            return {n: self._written.pop(n) for n in names}


def _os_error(exc: BaseException) -> OSError | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _failed(step: int | None, folder: Path, exc: BaseException) -> DcpWriteError:
    err = _os_error(exc)
    what = f"{err.strerror or err} (errno {err.errno})" if err else f"{type(exc).__name__}: {exc}"
    # The writer subprocess's OSError arrives as a WriterError that keeps its errno.
    code = err.errno if err else getattr(exc, "errno", None)
    return DcpWriteError(
        f"DCP save of step {step} into {folder} failed: {what}; "
        "the previous checkpoint is untouched",
        errno=code if isinstance(code, int) else None,
    )


def write_record(folder: Path, name: str, data: bytes) -> None:
    """Write a small file under its final name atomically and durably."""
    tmp = folder / f"{layout.TMP_PREFIX}{name}.{os.getpid()}"
    write_file_durably(tmp, data)
    os.replace(tmp, folder / name)
    fsync_dir(folder)


def read_record(path: Path, kind: type[_R]) -> _R:
    """Decode one of our JSON records, bounded in size, any failure as corruption."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RECORD_BYTES + 1)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{path} is missing") from exc
    except OSError as exc:
        raise CheckpointCorruptError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(raw) > MAX_RECORD_BYTES:
        raise CheckpointCorruptError(f"{path}: over {MAX_RECORD_BYTES} bytes, not a record of ours")
    try:
        record = msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as exc:
        raise CheckpointCorruptError(f"{path}: unreadable record: {exc}") from exc
    if bad_names(record.files):
        raise CheckpointCorruptError(
            f"{path}: lists {bad_names(record.files)[:3]}, expected file names inside the folder"
        )
    if record.format != FORMAT_VERSION:
        raise CheckpointCorruptError(f"{path}: format {record.format!r}, expected {FORMAT_VERSION}")
    return record


def verify_entries(folder: Path, files: Mapping[str, FileEntry]) -> None:
    """Raise CheckpointCorruptError unless every file matches the size and checksum that
    the commit record gives it."""
    manifest.verify_entries(folder, files, "the commit record")


class DcpWriter(FileSystemWriter):
    """A DCP storage writer for ``<root>/step_<step>`` with stalwart's commit protocol.

    Give ``step`` here, or a ``checkpoint_id`` naming a step folder to ``dcp.save``.
    ``keep_last``: how many committed steps stay (None: all).
    ``subprocess``: write the shard files from stalwart's writer subprocess, the tensors
    handed over in shared memory (True: this process's shared one, see
    :mod:`~stalwart.checkpoint.dcp_shards`); False: DCP writes them on its own thread.
    DCP storage extensions or safetensors output are written by DCP either way.
    ``ram``: under ``stalwart run --ckpt-ram`` (True) each rank also keeps its shards of
    the save in the launcher's memory, where :class:`DcpReader` and stalwart's loader
    find them after a restart; a :class:`~stalwart.checkpoint.ram.RamSegment`: that one;
    False: disk only.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        step: int | None = None,
        *,
        keep_last: int | None = 3,
        algorithm: str = DEFAULT_ALGORITHM,
        thread_count: int = 1,
        subprocess: ShardProcess | bool = False,
        ram: RamSegment | bool = True,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: expected >= 1 or None (keep everything)")
        new_hasher(algorithm)  # an unknown algorithm fails here, not in every rank's save
        self.root = Path(root)
        self.step = step
        folder = layout.step_dir(self.root, step) if step is not None else self.root
        super().__init__(folder, sync_files=True, thread_count=thread_count, overwrite=True)
        self.keep_last = keep_last
        self.fs: _HashingFileSystem = _HashingFileSystem(algorithm)
        if subprocess is True:
            from .dcp_shards import shared_process  # it imports this module

            subprocess = shared_process()
        self.shard_process: ShardProcess | None = subprocess or None
        self.ram_segment: RamSegment | None = None
        if ram is True:
            from .dcp_ram import local_segment  # it imports this module

            self.ram_segment = local_segment()
        elif ram is not False:
            self.ram_segment = ram
        self.is_coordinator = False
        self._save = ""
        self._mine: tuple[SavePrefix, dict[str, FileEntry]] | None = None

    @property
    def folder(self) -> Path:
        return Path(self.path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            folder = Path(checkpoint_id)
            step = layout.parse_step(folder.name)
            if step is None:
                raise ValueError(
                    f"checkpoint_id {str(checkpoint_id)!r}: expected a step folder like "
                    f"{layout.step_dir_name(0)!r}"
                )
            self.root, self.step = folder.parent, step
        elif self.step is None:
            raise ValueError("DcpWriter needs a step: pass step= or a checkpoint_id")

    def _guard(self, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except (WriterError, WriterDiedError) as exc:
            # The writer subprocess failed or died: said as this step's failure.
            raise _failed(self.step, self.folder, exc) from exc
        except CheckpointError:
            raise
        except Exception as exc:
            raise _failed(self.step, self.folder, exc) from exc

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.is_coordinator = is_coordinator
        self._mine = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        with warnings.catch_warnings():
            # Re-saving a step is expected here: the coordinator clears the folder.
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            return self._guard(lambda: super(DcpWriter, self).prepare_local_plan(plan))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank writes: what an earlier save of this
        # step left must not vouch for the shards about to be overwritten.
        self._guard(self._clear_folder)
        planned = super().prepare_global_plan(plans)
        self._save = secrets.token_hex(8)
        return [
            dataclasses.replace(
                p,
                storage_data=SavePrefix(p.storage_data.prefix, self._save, len(planned), i),
            )
            for i, p in enumerate(planned)
        ]

    def _clear_folder(self) -> None:
        # `latest` only moves forward at commit, so it may name this very step from an
        # earlier save: point it away first, or a kill during the re-save leaves it
        # naming a folder without a commit record.
        if self.step is not None and layout.read_latest(self.root) == self.step:
            present = layout.list_steps(self.root)
            committed = [s for s in present if is_committed(layout.step_dir(self.root, s))]
            before = latest_while_resaving(self.step, committed)
            link = self.root / layout.LATEST
            if before is None:
                link.unlink(missing_ok=True)
            else:
                replace_symlink(link, layout.step_dir_name(before))
            fsync_dir(self.root)
        for entry in self.folder.iterdir():
            if entry.is_file() or entry.is_symlink():
                entry.unlink()
        fsync_dir(self.folder)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            return self._guard(lambda: self._write_data_and_record(plan, planner))
        except BaseException:
            # Nothing half-written stays: this rank's files of the failed save go, and
            # the step folder too when no other rank has files in it.
            self._remove_own(plan.storage_data.prefix)
            raise

    def _remove_own(self, prefix: str) -> None:
        with contextlib.suppress(OSError):
            for entry in self.folder.iterdir():
                if entry.name.startswith(prefix) or entry.name.startswith(
                    f"{layout.TMP_PREFIX}{prefix}"
                ):
                    entry.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.folder.rmdir()

    def _write_data_and_record(
        self, plan: SavePlan, planner: SavePlanner
    ) -> Future[list[WriteResult]]:
        prefix: str = plan.storage_data.prefix
        proc = self.shard_process
        if proc is not None and self._plain_format() and proc.ready():
            results, entries = proc.write(
                self.folder, prefix, plan.items, planner, self.thread_count
            )
        else:
            results = super().write_data(plan, planner).wait()
            entries = self.fs.take({wr.storage_data.relative_path for wr in results})
        record = RankShards(FORMAT_VERSION, self.step or 0, prefix, entries)
        write_record(self.folder, rank_record_name(prefix), msgspec.json.encode(record))
        if isinstance(plan.storage_data, SavePrefix) and self.use_collectives:
            self._mine = (plan.storage_data, entries)
            if not self.is_coordinator:
                # No call reaches this rank after the commit: its copy goes in now, and
                # counts only once the coordinator's copy of this save (after the
                # commit) is there too.
                self._keep_in_ram(None)
        done: Future[list[WriteResult]] = Future()  # DCP's futures are torch's
        done.set_result(results)
        return done

    def _plain_format(self) -> bool:
        # Transforms (compression) and safetensors output change the bytes DCP writes;
        # the subprocess writes DCP's default format only.
        return (
            self.single_file_per_rank
            and not self.transforms.extensions
            and self.serialization_format is SerializationFormat.TORCH_SAVE
        )

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._guard(lambda: self._finish_and_commit(metadata, results))
        except BaseException:
            # Every rank's shards are in, but the step cannot be committed: none of it
            # is of use, and a later save of this step starts from an empty folder.
            remove_tree(self.folder)
            raise
        self._after_commit()
        if self.ram_segment is not None and self._mine is not None:
            # The metadata as written, not the object DCP handed us: torch 2.13's
            # FileSystemWriter.finish fills the caller's object with the storage table,
            # 2.11's (seen on a lent GPU machine) does not, and RAM then held metadata
            # "without its tables" that no restore could use.
            metadata = read_metadata(self.folder / METADATA_NAME)
        self._keep_in_ram(metadata)

    def _keep_in_ram(self, metadata: Metadata | None) -> None:
        if self.ram_segment is None or self._mine is None or self.step is None:
            return
        from .dcp_ram import try_snapshot

        prefix, entries = self._mine
        try_snapshot(
            self.ram_segment,
            self.root,
            self.step,
            entries,
            metadata,
            prefix.rank,
            prefix.world_size,
            prefix.save,
        )

    def _finish_and_commit(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        fsync_dir(self.folder)
        # DCP writes its metadata under a temporary name, then renames it.
        (meta,) = self.fs.take([f"{METADATA_NAME}.tmp"]).values()
        files: dict[str, FileEntry] = {METADATA_NAME: meta}
        for i, rank_results in enumerate(results):
            prefix = f"__{i}_"
            shards = read_record(self.folder / rank_record_name(prefix), RankShards)
            wrote = {wr.storage_data.relative_path for wr in rank_results}
            if not wrote <= shards.files.keys():
                raise CheckpointCorruptError(
                    f"{self.folder}: rank {i} reported {sorted(wrote - shards.files.keys())} "
                    "that its record does not list"
                )
            files.update(shards.files)
        commit = DcpCommit(
            FORMAT_VERSION, self.step or 0, len(results), files, time.time(), self._save
        )
        write_record(self.folder, COMMIT_NAME, msgspec.json.encode(commit))

    def _after_commit(self) -> None:
        # The step is durable; what follows is housekeeping that must not fail the save.
        try:
            current = layout.read_latest(self.root)
            if self.step is not None and (current is None or current <= self.step):
                replace_symlink(self.root / layout.LATEST, layout.step_dir_name(self.step))
            if self.keep_last is not None:
                present = layout.list_steps(self.root)
                committed = [s for s in present if is_committed(layout.step_dir(self.root, s))]
                for s in steps_to_delete(committed, present, self.keep_last):
                    logger.info("retention: deleting DCP step %d", s)
                    remove_tree(layout.step_dir(self.root, s))
        except OSError as exc:
            logger.warning("step %s committed, but housekeeping failed: %s", self.step, exc)


def latest_while_resaving(step: int, committed: Iterable[int]) -> int | None:
    """The step ``latest`` names while `step`, which it named, is cleared and written
    again: the newest other committed step before it, or None (no pointer) if none."""
    older = [s for s in committed if s < step]
    return max(older) if older else None


def is_committed(folder: Path) -> bool:
    return (folder / COMMIT_NAME).is_file()


class DcpReader(FileSystemReader):
    """A DCP storage reader that never unpickles more than DCP's metadata classes and,
    for a step stalwart committed, checks the shards it reads before reading them.

    ``verify=False`` skips the checksums (the loader verified the whole step already).
    ``ram`` (under ``stalwart run --ckpt-ram``): when every rank finds verified RAM copies
    of the shards it reads, of the save this folder's commit record names, all read them
    from RAM instead of the files; else all read the files.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, verify: bool = True, ram: bool = True
    ) -> None:
        super().__init__(path)
        self.verify = verify
        self.ram = ram
        self._rank = 0
        self._source: RamSource | None = None

    @property
    def folder(self) -> Path:
        return Path(self.path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return stamp_load_id(read_metadata(self.folder / METADATA_NAME), self.load_id)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        plan = super().prepare_local_plan(plan)
        self._drop_source()
        if not self.ram:
            return plan
        from .dcp_ramsource import RamVote, offer

        needed = {self.storage_data[item.storage_index].relative_path for item in plan.items}
        self._source = offer(self.folder, needed, self._rank)
        return dataclasses.replace(plan, storage_data=RamVote(self._source is not None))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        plans = super().prepare_global_plan(plans)
        from .dcp_ramsource import RamVote, agreed

        use = agreed(p.storage_data for p in plans)
        return [dataclasses.replace(p, storage_data=RamVote(use)) for p in plans]

    def _drop_source(self) -> None:
        source, self._source = self._source, None
        if source is not None:
            source.close()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        source, self._source = self._source, None
        try:
            if source is not None and getattr(plan.storage_data, "ok", False):
                return self._read_ram(source, plan, planner)
            return self._read_disk(plan, planner)
        finally:
            if source is not None:
                source.close()

    def _read_ram(self, source: RamSource, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from .dcp_items import read_items
        from .dcp_ram import extent

        # Each item from the slot it was verified in, by one copy into DCP's destination.
        read_items(self, plan, planner, lambda sinfo: extent(source.files, sinfo))
        source.check_unchanged()
        logger.info("rank %d resumes from step %d (ram, %s)", self._rank, source.step, source.where)
        runlog.emit(runlog.CHECKPOINT_RESTORED, step=source.step, source="ram", path=source.where)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_disk(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self.verify and is_committed(self.folder):
            commit = read_record(self.folder / COMMIT_NAME, DcpCommit)
            touched = {self.storage_data[item.storage_index].relative_path for item in plan.items}
            missing = touched - commit.files.keys()
            if missing:
                raise CheckpointCorruptError(
                    f"{self.folder}: metadata names {sorted(missing)[:3]} that the commit lacks"
                )
            verify_entries(self.folder, {n: commit.files[n] for n in touched})
        done = super().read_data(plan, planner)
        step = layout.parse_step(self.folder.name)
        if step is not None:
            runlog.emit(runlog.CHECKPOINT_RESTORED, step=step, source="disk", path=str(self.folder))
        return done


def stamp_load_id(md: Metadata, load_id: str) -> Metadata:
    """DCP's readers hand the planner metadata carrying this load's id; a checkpoint
    written without storage metadata gets an empty record to carry it."""
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    assert md.storage_meta is not None
    md.storage_meta.load_id = load_id
    return md
