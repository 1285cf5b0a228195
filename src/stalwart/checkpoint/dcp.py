"""Sharded checkpoints (DCP, FSDP2, DTensor state dicts) with stalwart's guarantees.

``save``/``async_save`` call DCP's own ``dcp.save``/``dcp.async_save`` with
:class:`~stalwart.checkpoint.dcp_storage.DcpWriter` (atomic commit across ranks,
checksums, keep-last) and, for the asynchronous one,
:class:`~stalwart.checkpoint.dcp_stager.ReusingStager`. ``load_newest`` is the
collective loader: the ranks agree on the newest step every one of them sees,
verify it together (each rank checksums a disjoint slice of its files), and
fall back step by step, all together, past any that fails; it also loads plain
``dcp.save`` folders under the root. DCP reshards at load, so a job restarted
at another world size loads the same steps.

Anything with ``state_dict``/``load_state_dict`` in the state dict (DCP's
``Stateful`` protocol: a data loader's position, an RNG) is saved and restored
by DCP itself.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from stalwart.base.pgdevice import device_type_for, group_device

from . import layout
from .dcp_metadata import read_metadata, shard_extents
from .dcp_ram import load_from_ram, local_segment
from .dcp_records import COMMIT_NAME, METADATA_NAME, DcpCommit, next_candidate, share_of
from .dcp_shards import ShardProcess
from .dcp_stager import ReusingStager
from .dcp_storage import DcpReader, DcpWriter, read_record, verify_entries
from .errors import CheckpointCorruptError, CheckpointError
from .process_args import WriterProcessConfig
from .ram import RamSegment
from .writer import SaveResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepScan:
    """The step folders under a root, by what they hold."""

    committed: list[int]
    plain: list[int]


def scan(root: str | os.PathLike[str]) -> StepScan:
    """Committed stalwart steps and plain DCP folders under ``root``, newest first.

    A folder with per-rank records but no commit is a save that did not finish and
    is neither; so is a folder without DCP metadata.
    """
    base = Path(root)
    committed: list[int] = []
    plain: list[int] = []
    for step in layout.list_steps(base):
        folder = layout.step_dir(base, step)
        if (folder / COMMIT_NAME).is_file():
            committed.append(step)
        elif (folder / METADATA_NAME).is_file() and not _has_rank_records(folder):
            plain.append(step)
    return StepScan(committed, plain)


def _has_rank_records(folder: Path) -> bool:
    try:
        return any(p.name.endswith(".stalwart.json") for p in folder.iterdir())
    except OSError:
        return False


def verify_share(folder: Path, rank: int, world_size: int) -> None:
    """Check this rank's slice of a step (raises CheckpointCorruptError).

    Every rank reads the metadata through the restricted unpickler; the shards are
    split among the ranks. A committed step is checked against its checksums, a
    plain DCP folder only for files long enough for what its metadata says.
    """
    if (folder / COMMIT_NAME).is_file():
        commit = read_record(folder / COMMIT_NAME, DcpCommit)
        if METADATA_NAME not in commit.files:
            raise CheckpointCorruptError(f"{folder}: the commit record lacks {METADATA_NAME}")
        verify_entries(folder, {METADATA_NAME: commit.files[METADATA_NAME]})
        md = read_metadata(folder / METADATA_NAME)
        missing = shard_extents(md).keys() - commit.files.keys()
        if missing:
            raise CheckpointCorruptError(
                f"{folder}: metadata names {sorted(missing)[:3]} that the commit lacks"
            )
        mine = share_of([n for n in commit.files if n != METADATA_NAME], rank, world_size)
        verify_entries(folder, {n: commit.files[n] for n in mine})
        return
    md = read_metadata(folder / METADATA_NAME)
    extents = shard_extents(md)
    for name in share_of(list(extents), rank, world_size):
        try:
            size = os.stat(folder / name).st_size
        except OSError as exc:
            raise CheckpointCorruptError(f"{folder / name}: {exc.strerror or exc}") from exc
        if size < extents[name]:
            raise CheckpointCorruptError(
                f"{folder / name}: {size} bytes, the metadata needs {extents[name]}"
            )


def _agree_min(value: int, group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    # On the caller's group, which may be NCCL alone (no CPU tensors).
    t = torch.tensor([value], dtype=torch.int64, device=group_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def _rank_world(group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def load_newest(
    state_dict: dict[str, Any],
    root: str | os.PathLike[str],
    *,
    process_group: Any = None,
    planner: Any = None,
) -> int | None:
    """Load the newest step that every rank finds and that verifies, in place.

    Collective over ``process_group`` (the default group when initialised). Returns
    the step loaded, or None when there is none (``state_dict`` untouched).
    """
    base = Path(root)
    rank, world = _rank_world(process_group)
    # Under --ckpt-ram: the step every rank holds in memory, when it is the newest.
    found = scan(base)
    newest = next_candidate(found.committed, found.plain, None)
    from_ram = load_from_ram(state_dict, base, newest, process_group=process_group, planner=planner)
    if from_ram is not None:
        return from_ram
    below: int | None = None
    while True:
        found = scan(base)
        step = _agree_min(next_candidate(found.committed, found.plain, below), process_group)
        if step < 0:
            return None
        folder = layout.step_dir(base, step)
        try:
            verify_share(folder, rank, world)
            ok = 1
        except CheckpointCorruptError as exc:
            logger.warning(
                "rank %d: step %d does not verify, trying an older one: %s", rank, step, exc
            )
            ok = 0
        if _agree_min(ok, process_group):
            # RAM was tried above, for every step it could serve; the reader reports
            # the restore.
            dcp_load(
                state_dict,
                storage_reader=DcpReader(folder, verify=False, ram=False),
                planner=planner,
                process_group=process_group,
            )
            return step
        below = step


def save(
    state_dict: dict[str, Any],
    root: str | os.PathLike[str],
    step: int,
    *,
    keep_last: int | None = 3,
    process_group: Any = None,
    planner: Any = None,
    ram: RamSegment | bool = True,
) -> Metadata:
    """``dcp.save`` as step ``step`` of ``root`` with stalwart's commit (collective).

    Under ``stalwart run --ckpt-ram`` (and ``ram``) each rank also keeps its shards of the
    step in the launcher's memory, for ``load_newest`` after a restart (``ram``: see
    :class:`~stalwart.checkpoint.dcp_storage.DcpWriter`).
    """
    writer = DcpWriter(root, step, keep_last=keep_last, ram=ram)
    try:
        metadata: Metadata = dcp_save(
            state_dict, storage_writer=writer, planner=planner, process_group=process_group
        )
    except CheckpointException as exc:
        raise unwrap(exc) from exc
    return metadata


def unwrap(exc: BaseException) -> BaseException:
    """The first rank's own error out of DCP's ``CheckpointException`` (which lists
    every rank's traceback), so a full disk reads as one line naming it."""
    if isinstance(exc, CheckpointException):
        for failed, _ in exc.failures.values():
            if isinstance(failed, CheckpointError):
                return failed
    return exc


def release_group(group: Any) -> None:
    """Destroy ``group`` and let go of it, so its gloo threads are joined now.

    ``dist.destroy_process_group`` only unregisters a group; the C++ object, with its
    worker and transport threads, lives as long as a Python reference does. Kept until
    the interpreter finalizes, it is torn down there, and a worker thread that then
    needs the GIL (a Python future callback, a tensor whose Python object it drops)
    kills the process: "terminate called without an active exception", exit -6. The
    caller drops its own reference; this is the last one.
    """
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group(group)
        except ValueError:
            # Already destroyed by the program (destroy_process_group() of every group
            # leaves is_initialized() False; one of its own, only this group).
            logger.debug("the saver's process group was already destroyed")


class AsyncDcpSaver:
    """Asynchronous DCP saves of one job into ``root``, staging into reused buffers.

    ``save`` returns once the copy is queued; ``staged`` of the returned pair
    resolves when the state may change again, ``done`` once the step is committed.
    The next save waits for the previous one's upload (the buffers are shared).
    Under ``stalwart run --ckpt-ram`` (unless ``ram=False``) a committed step is also
    kept in the launcher's memory before ``done`` resolves (``segment``: the mapped
    segment to use, else this local rank's). ``subprocess`` (default): the shard files
    are written, checksummed and fsync'd by a writer subprocess of this saver's from
    shared memory (see :mod:`~stalwart.checkpoint.dcp_shards`), not by DCP's thread
    in this process; ``writer_config``: its start-up and write timeouts and niceness
    (without one the writer runs at nice ``DCP_WRITER_NICE``, 0: see process_args).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        process_group: Any = None,
        background: bool = True,
        ram: bool = True,
        segment: RamSegment | None = None,
        subprocess: bool = True,
        writer_config: WriterProcessConfig | None = None,
    ) -> None:
        if process_group is not None and dist.is_available() and dist.is_initialized():
            backend = str(dist.get_backend(process_group))
            # The save runs on this saver's thread while the loop runs its own
            # collectives: on the loop's NCCL group they would interleave (dcp.async_save
            # refuses such a group too, at the first save).
            if device_type_for(backend) != "cpu":
                raise ValueError(
                    f"AsyncDcpSaver(process_group=...): a {backend!r} group; expected one "
                    "with a CPU backend (gloo, or 'cpu:gloo,cuda:nccl'), or None for a gloo "
                    "group of the saver's own"
                )
        self.root = Path(root)
        self._segment = (segment or local_segment()) if ram else None
        self.keep_last = keep_last
        self._own_group = False
        if process_group is None and dist.is_available() and dist.is_initialized():
            # The upload's collectives run on a thread while the loop runs its own:
            # sharing one group would interleave them (collective: every rank builds
            # its saver at the same point).
            process_group = dist.new_group(backend="gloo")
            self._own_group = True
        self.process_group = process_group
        # Started now, so its interpreter is up by the first save's write.
        self.shard_process = ShardProcess(config=writer_config) if subprocess else None
        # Staged straight into the writer's shared buffer: each tensor is copied once.
        # In the background, the upload thread stages before it uploads (one thread, so
        # the next staging follows the previous upload by construction); else the
        # caller's thread stages.
        self.stager = ReusingStager(background=False, arena=self.shard_process)
        self._stage_in_upload = background
        self._upload = ThreadPoolExecutor(1, thread_name_prefix="stalwart-dcp-upload")
        self._last: Future[Any] | None = None
        #: The bytes the latest save stages (resolved once its staging walked the state).
        self.staged_bytes: Future[int] = Future()
        self.staged_bytes.set_result(0)
        # A saver the program never closes is closed before the interpreter finalizes
        # (atexit runs while it is whole), never by its teardown: see release_group.
        self._pid = os.getpid()
        atexit.register(self._close_at_exit)

    def save(self, state_dict: dict[str, Any], step: int) -> tuple[Future[None], Future[Any]]:
        writer = DcpWriter(
            self.root,
            step,
            keep_last=self.keep_last,
            subprocess=self.shard_process or False,
            ram=self._segment or False,
        )
        if self._last is not None:
            self._last.exception()
        # What dcp.async_save does, on a thread this saver keeps: dcp.async_save starts
        # a thread per call, and the hand-over of the interpreter lock to a new thread
        # while staging walks the state dict was most of the loop's stall. Stateful
        # objects give their state now, on the caller's thread, as DCP's async_save does.
        state = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
        staged: Future[None] = Future()
        upload: Future[Any] = Future()
        sized: Future[int] = Future()
        self.staged_bytes = sized
        early = None
        if not self._stage_in_upload:
            early = self.stager.stage(state)
            sized.set_result(self.stager.staged_bytes.result())
        self._upload.submit(self._run_save, state, early, writer, (sized, staged, upload))
        self._last = upload
        return staged, upload

    def _run_save(
        self,
        state: dict[str, Any],
        early: Future[dict[str, Any]] | dict[str, Any] | None,
        writer: DcpWriter,
        futures: tuple[Future[int], Future[None], Future[Any]],
    ) -> None:
        sized, staged, upload = futures
        try:
            got = self.stager.stage(state) if early is None else early
            copy = got.result() if isinstance(got, Future) else got
            if not sized.done():
                sized.set_result(self.stager.staged_bytes.result())
        except BaseException as exc:
            sized.cancel()
            staged.set_exception(exc)
            upload.set_exception(exc)
            return
        staged.set_result(None)
        try:
            metadata = dcp_save(copy, storage_writer=writer, process_group=self.process_group)
        except BaseException as exc:
            upload.set_exception(unwrap(exc))
            return
        # The writer kept the RAM copy on this thread, off the training one.
        upload.set_result(metadata)

    def wait(self) -> None:
        if self._last is not None:
            self._last.result()

    def close(self) -> None:
        """Wait for the last save, stop the staging thread and the writer subprocess, and
        destroy the process group this saver made (idempotent; also run at exit)."""
        atexit.unregister(self._close_at_exit)
        try:
            if self._last is not None:
                self._last.exception()
        finally:
            self._upload.shutdown(wait=True)
            self.stager.close()
            if self.shard_process is not None:
                # Never used and still importing torch: nothing to wait for.
                self.shard_process.close(abandon_unused_start=True)
            group, self.process_group = self.process_group, None
            if self._own_group and group is not None:
                self._own_group = False
                release_group(group)

    def _close_at_exit(self) -> None:
        # A child forked from this process inherits the handler, not the saver's threads,
        # group or writer: closing them there would stop the parent's writer.
        if os.getpid() == self._pid:
            self.close()


class ShardedSaves:
    """``AsyncCheckpointer``'s sharded path: its saves of DTensor / ``Stateful`` state
    go through DCP (collective: every rank calls ``save`` for the same step)."""

    def __init__(
        self, root: Path, keep_last: int | None, rank: int, segment: RamSegment | None
    ) -> None:
        self.rank = rank
        self._saver = AsyncDcpSaver(
            root, keep_last=keep_last, ram=segment is not None, segment=segment
        )

    def save(self, state_dict: dict[str, Any], step: int) -> Future[SaveResult]:
        """A Future of the committed step's :class:`SaveResult`; its ``staged`` event
        is set once the state may change again."""
        t0 = time.perf_counter()
        staged_fut, upload = self._saver.save(state_dict, step)
        result: Future[SaveResult] = Future()
        staged = threading.Event()
        result.staged = staged  # type: ignore[attr-defined]
        staged_fut.add_done_callback(lambda _: staged.set())
        folder = layout.step_dir(self._saver.root, step)
        # This save's: the next one replaces the stager's future.
        sized = self._saver.staged_bytes

        def finished(fut: Future[Any]) -> None:
            exc = fut.exception()
            if exc is not None:
                result.set_exception(unwrap(exc))
                return
            write_s = time.perf_counter() - t0
            # Staging is done before any upload completes.
            nbytes = sized.result()
            result.set_result(SaveResult(step, self.rank, folder, nbytes, "", write_s, True))

        upload.add_done_callback(finished)
        return result

    def close(self) -> None:
        self._saver.close()
