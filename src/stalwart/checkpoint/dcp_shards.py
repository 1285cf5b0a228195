"""DCP shard files written by stalwart's writer subprocess.

The rank plans its shard files as DCP's ``FileSystemWriter`` does (same file names,
same split of items into files) and resolves each write item to its data; the
tensors go into the writer's shared staging buffer (``staging.py``) and only the
file layout plus the small serialized items travel over the pipe. Tensors that
:class:`~stalwart.checkpoint.dcp_stager.ReusingStager` staged into that buffer already
(``ShardProcess.lend``) are written from where they are, not copied again. The subprocess
writes each ``.distcp`` file in DCP's own format (raw bytes for byte items,
``torch.save`` records for tensors), hashes it as it goes, fsyncs it and answers
with every item's offset and length, which the rank turns into DCP's
``WriteResult``s. The training process then spends no core time on disk I/O or
checksums, and a writer killed mid-write fails this save on every rank (DCP
gathers write failures), so the step is never committed.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import threading
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .dcp_shard_writer import FILES_KEY, ShardFileWriter, WrittenFile
from .manifest import DEFAULT_ALGORITHM, FileEntry
from .process import CheckpointProcess, CopyStats
from .process_args import DCP_WRITER_NICE, WriterProcessConfig

logger = logging.getLogger(__name__)

SHARD_SUFFIX = ".distcp"


def file_layout(
    prefix: str, items: list[WriteItem], files: int
) -> list[tuple[str, list[WriteItem]]]:
    """DCP's split of one rank's items into ``files`` files and their names: byte items
    dealt round-robin, tensors largest first onto the lightest file."""
    if files < 1:
        raise ValueError(f"files={files}: expected >= 1")
    buckets: list[list[WriteItem]] = [[] for _ in range(files)]
    sizes = [0] * files
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensor_items = [i for i in items if i.type != WriteItemType.BYTE_IO]
    for n, item in enumerate(byte_items):
        buckets[n % files].append(item)
    for item in sorted(tensor_items, key=_item_bytes, reverse=True):
        i = sizes.index(min(sizes))
        buckets[i].append(item)
        sizes[i] += _item_bytes(item)
    # DCP writes a file's byte items before its tensors; offsets follow that order.
    ordered = [
        [i for i in b if i.type == WriteItemType.BYTE_IO]
        + [i for i in b if i.type != WriteItemType.BYTE_IO]
        for b in buckets
    ]
    return [(f"{prefix}{n}{SHARD_SUFFIX}", b) for n, b in enumerate(ordered)]


def _item_bytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    n = 1
    for s in item.tensor_data.size:
        n *= s
    return n * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


def _resolve(planner: SavePlanner, item: WriteItem) -> bytes | torch.Tensor:
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise TypeError(f"{item.index.fqn}: a byte item resolved to {type(data).__name__}")
        return data.getvalue()
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{item.index.fqn}: a tensor item resolved to {type(data).__name__}")
    # The staging copy writes the tensor's own elements only (a narrowed view of a
    # larger staged tensor included), so the subprocess saves exactly these.
    return data.detach().cpu()


def write_results(
    files: list[tuple[str, list[WriteItem]]], written: list[WrittenFile]
) -> list[WriteResult]:
    """DCP's ``WriteResult``s from what the subprocess reports; any mismatch with the
    layout asked for is an error, never a guess."""
    by_name = {w.name: w for w in written}
    results: list[WriteResult] = []
    for name, items in files:
        w = by_name.get(name)
        if w is None or len(w.extents) != len(items):
            raise RuntimeError(
                f"the checkpoint writer reported {None if w is None else len(w.extents)} "
                f"items for {name}, expected {len(items)}"
            )
        for item, (offset, length) in zip(items, w.extents, strict=True):
            info = _StorageInfo(name, offset, length)
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
    return results


class ShardProcess:
    """The rank's writer subprocess for DCP shard files (one per process is enough:
    DCP writes one save at a time per rank)."""

    def __init__(
        self, *, algorithm: str = DEFAULT_ALGORITHM, config: WriterProcessConfig | None = None
    ) -> None:
        self.algorithm = algorithm
        self._proc = CheckpointProcess(
            ShardFileWriter,
            {"algorithm": algorithm},
            config=config or WriterProcessConfig(writer_nice=DCP_WRITER_NICE),
        )
        self._lock = threading.Lock()
        self._start_failure_logged = False
        # Saves whose shards this subprocess wrote.
        self.writes = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def ready(self) -> bool:
        """Whether the subprocess has started and answered; until then (or when its
        start failed) DCP writes the shards itself, so no save waits for an interpreter
        to start."""
        started = self._proc.process_creation_future
        if not started.done():
            return False
        failed = started.exception()
        if failed is not None and not self._start_failure_logged:
            self._start_failure_logged = True
            logger.warning(
                "DCP shards are written in the rank: the writer did not start: %s", failed
            )
        return failed is None

    def wait_ready(self, timeout: float | None = None) -> None:
        self._proc.wait_ready(timeout)

    def lend(self, nbytes: int) -> torch.Tensor:
        """The writer's shared buffer to stage into (see ``CheckpointProcess.lend``): a
        :class:`~stalwart.checkpoint.dcp_stager.ReusingStager` given this process as its
        arena stages there, and :meth:`write` then copies none of those tensors."""
        return self._proc.lend(nbytes)

    @property
    def copy_stats(self) -> CopyStats:
        return self._proc.copy_stats

    def write(
        self,
        folder: Path,
        prefix: str,
        items: list[WriteItem],
        planner: SavePlanner,
        files: int = 1,
    ) -> tuple[list[WriteResult], dict[str, FileEntry]]:
        """Write one rank's items as DCP shard files; their results and file entries."""
        layout = file_layout(prefix, items, files)
        payload = {FILES_KEY: [(name, [_resolve(planner, i) for i in b]) for name, b in layout]}
        with self._lock:
            written: list[WrittenFile] = self._proc.write(payload, str(folder)).result()
            self.writes += 1
        return write_results(layout, written), {w.name: w.entry for w in written}

    def close(self, *, abandon_unused_start: bool = False) -> None:
        """Stop the subprocess; ``abandon_unused_start``: one that never wrote and is still
        starting is killed rather than waited for."""
        self._proc.close(abandon_unused_start=abandon_unused_start)


_shared_lock = threading.Lock()
_shared: tuple[int, ShardProcess] | None = None


def shared_process() -> ShardProcess:
    """This process's writer subprocess for ``DcpWriter(subprocess=True)``, started on
    first use and closed at exit (a forked child gets its own)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared[0] != os.getpid():
            proc = ShardProcess()
            _shared = (os.getpid(), proc)
            atexit.register(proc.close)
        return _shared[1]
