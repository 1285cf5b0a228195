"""The high-level API a training loop uses: ``AsyncCheckpointer``.

One instance per rank. It owns a writer subprocess (started and warmed when the
checkpointer is built) and turns ``save(state_dict, step)`` into a snapshot
into shared memory plus an asynchronous, atomic, checksummed write.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from stalwart import runlog

from . import layout
from .identity import resolve_rank, resolve_world_size
from .loader import Loaded
from .manifest import DEFAULT_ALGORITHM
from .process import CheckpointProcess
from .process_args import WriterProcessConfig
from .ram import RamSegment, SnapshotTooLargeError, open_local
from .sharded import holds_sharded
from .staging import TENSOR_ALIGN, StagingPlan, check_unchanged, plan
from .writer import SaveResult, TorchFileWriter

logger = logging.getLogger(__name__)


class StagingMode(enum.Enum):
    """When the tensors are copied into the staging buffer.

    SYNC: inside ``save()``; the caller may change its tensors as soon as
    ``save()`` returns. BACKGROUND: on the I/O thread; ``save()`` returns after
    pickling the non-tensor state, and the caller must not modify tensors in
    place until ``wait_staged()`` returns. With ``guard_optimizers`` every
    ``optimizer.step()`` waits for that automatically, with ``guard_modules``
    every module forward does (BatchNorm updates its running statistics in
    place in forward), and a tensor that was modified anyway through its
    autograd version counter is detected and fails that save rather than
    writing a torn checkpoint. Writes through ``.data`` bypass the version
    counter and are not detected: that is why SYNC stays the default.
    """

    SYNC = "sync"
    BACKGROUND = "background"


def _default_copy_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True, kw_only=True)
class CheckpointerConfig(WriterProcessConfig):
    """The writer process's settings (declared in ``WriterProcessConfig``) and the
    checkpointer's own."""

    # The checkpointer's own default; a bare CheckpointProcess waits 60 s.
    init_timeout_s: float = 120.0
    staging: StagingMode = StagingMode.SYNC
    guard_optimizers: bool = True
    # BACKGROUND only: a global module forward pre-hook waits for staging.
    guard_modules: bool = True
    # The caller is blocked during a SYNC copy anyway, so use several cores.
    copy_threads: int = 0  # 0: min(4, cpu_count)
    checksum: str | None = None  # None: xxh3_64; "crc32" also accepted
    # With reserve_bytes=0: after an optimizer's first step, size the buffer in
    # the background for its parameters plus its state (what a resumable
    # checkpoint holds), so the first save does not fault in fresh memory. A
    # reservation larger than the first save needed is trimmed after it.
    auto_reserve: bool = True
    # Write the file with O_DIRECT through a few reused aligned buffers where the
    # file system allows it (see docs/checkpoint.md); False: through the page cache.
    direct_io: bool = True
    # Write every N-th save to disk; the others only snapshot (into the launcher's
    # memory under `stalwart run --ckpt-ram`, else nowhere). 1: every save.
    persist_every: int = 1
    # Keep snapshots in the launcher's memory when it offers some (STALWART_CKPT_RAM_DIR).
    ram: bool = True


class AsyncCheckpointer:
    """Asynchronous, atomic checkpoints of one rank into ``directory``.

    ``rank`` and ``world_size`` default to the ``RANK`` / ``WORLD_SIZE``
    environment variables that stalwart and torchrun set, then to an
    initialised process group, then to 0 and 1.
    A step counts as complete once all ``world_size`` ranks committed it.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep_last: int | None = 3,
        rank: int | None = None,
        *,
        world_size: int | None = None,
        config: CheckpointerConfig | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 or None (keep everything)")
        self.directory = Path(directory)
        self.rank = resolve_rank(rank)
        self.world_size = resolve_world_size(world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is outside world_size {self.world_size}; pass world_size= "
                "(or set WORLD_SIZE) so a step is complete only once every rank wrote it"
            )
        self.config = config or CheckpointerConfig()
        if self.config.persist_every < 1:
            raise ValueError(
                f"persist_every={self.config.persist_every}: expected >= 1 (1: every save)"
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        self._ram: RamSegment | None = None
        self._saves = 0
        # Hashing and committing a RAM snapshot runs here, off the training thread; the
        # next snapshot waits for the previous commit (see RamSegment.stage).
        self._ram_committer: ThreadPoolExecutor | None = None
        self._ram_commit: Future[SaveResult] | None = None
        if self.config.ram:
            self._ram, why = open_local()
        else:
            why = "CheckpointerConfig(ram=False)"
        if self._ram is None:
            # One line, so a job learns why a restart reads the disk.
            log = logger.warning if self.config.persist_every > 1 else logger.info
            log("rank %d: checkpoint snapshots go to disk only: %s", self.rank, why)
        self.last_stall_s = 0.0
        self._inflight: list[Future[SaveResult]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._writer_kwargs: dict[str, Any] = {
            "root": str(self.directory),
            "rank": self.rank,
            "world_size": self.world_size,
            "keep_last": keep_last,
            "algorithm": self.config.checksum or DEFAULT_ALGORITHM,
            "direct_io": self.config.direct_io,
        }
        self._writer: CheckpointProcess | None = None
        # DTensor / Stateful state goes through DCP (see dcp.py), built on first use.
        self._sharded: Any = None
        if self._ram is None or not self._ram.records():
            self._start_writer()
        else:
            # The snapshot the restore will read is hashed meanwhile, off this thread.
            self._ram.start_checking(self.rank, self.world_size)
        # else: a restarted worker with snapshots in RAM restores first; the writer
        # child (a fresh interpreter importing torch, seconds of CPU) starts at the
        # first call that needs it (a save that goes to disk, wait_ready,
        # reserve_for), so it takes no core from the restore and the first steps
        # after it. A save does not wait for it: its write does, on the I/O thread.
        self._hooks: list[Any] = []
        # Read without the lock by the forward guard: a plain bool is enough to
        # skip the lock on the hot path; wait_staged decides under the lock.
        self._maybe_unstaged = False
        background = self.config.staging is StagingMode.BACKGROUND
        if background and self.config.guard_optimizers:
            self._hooks.append(register_optimizer_step_pre_hook(self._before_optimizer_step))
        if background and self.config.guard_modules:
            self._hooks.append(register_module_forward_pre_hook(self._before_forward))
        self._saved_once = False
        self._auto_reserved = 0
        self._optimizer_bytes: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        if self.config.auto_reserve and not self.config.reserve_bytes:
            self._hooks.append(register_optimizer_step_post_hook(self._after_optimizer_step))

    def _start_writer(self) -> CheckpointProcess:
        if self._writer is None:
            self._writer = CheckpointProcess(
                TorchFileWriter,
                self._writer_kwargs,
                config=dataclasses.replace(
                    self.config, copy_threads=self.config.copy_threads or _default_copy_threads()
                ),
            )
        return self._writer

    @property
    def _process(self) -> CheckpointProcess:
        return self._start_writer()

    @property
    def writer_pid(self) -> int | None:
        """Pid of the current writer subprocess (None while none is running)."""
        return None if self._writer is None else self._writer.pid

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the writer subprocess is up (``save`` does not need this)."""
        self._process.wait_ready(timeout)

    def save(
        self, state_dict: Any, step: int, *, metadata: dict[str, Any] | None = None
    ) -> Future[SaveResult]:
        """Snapshot ``state_dict`` and write it as ``step`` in the background.

        ``state_dict`` may also be a Future of one. Returns a Future of the
        :class:`SaveResult`; a failed save raises from that Future (and from
        ``wait``), the previous checkpoints staying intact.
        """
        if self._closed:
            raise RuntimeError("AsyncCheckpointer is closed")
        if not isinstance(state_dict, Future) and holds_sharded(state_dict):
            return self._save_sharded(state_dict, step)
        path = str(layout.step_dir(self.directory, step))
        kwargs: dict[str, Any] = {"step": step, "metadata": metadata}
        t0 = time.perf_counter()
        self._saved_once = True
        self._saves += 1
        persist = self._saves % self.config.persist_every == 0
        planned: StagingPlan | None = None
        if self._ram is not None and not isinstance(state_dict, Future):
            planned = plan(state_dict)
            kept = self._save_ram(planned, step)
            if kept is not None and not persist:
                self.last_stall_s = time.perf_counter() - t0
                return kept
        elif not persist:
            done: Future[SaveResult] = Future()
            done.set_result(
                SaveResult(step, self.rank, Path(path), 0, "", 0.0, False, persisted=False)
            )
            self.last_stall_s = time.perf_counter() - t0
            return done
        if isinstance(state_dict, Future) or self.config.staging is StagingMode.BACKGROUND:
            staging = None if isinstance(state_dict, Future) else (planned or plan(state_dict))
            # Submitted and listed under the lock, so the guards' wait_staged
            # can never see "nothing unstaged" while this save is in between.
            with self._lock:
                self._maybe_unstaged = True
                if staging is None:
                    fut: Future[SaveResult] = self._process.write(state_dict, path, **kwargs)
                else:
                    fut = self._process.write_planned(staging, path, background=True, **kwargs)
                self._track(fut)
        else:
            fut = self._process.write_planned(
                planned or plan(state_dict), path, background=False, **kwargs
            )
            with self._lock:
                self._track(fut)
        self.last_stall_s = stall = time.perf_counter() - t0
        fut.add_done_callback(self._log_failure)
        fut.add_done_callback(lambda f: _record_commit(f, step, stall, t0, path))
        return fut

    def _save_sharded(self, state_dict: dict[str, Any], step: int) -> Future[SaveResult]:
        t0 = time.perf_counter()
        if self._sharded is None:
            from .dcp import ShardedSaves

            self._sharded = ShardedSaves(
                self.directory, self._writer_kwargs["keep_last"], self.rank, self._ram
            )
        with self._lock:
            fut: Future[SaveResult] = self._sharded.save(state_dict, step)
            self._maybe_unstaged = True
            self._track(fut)
        if self.config.staging is not StagingMode.BACKGROUND:
            fut.staged.wait()  # type: ignore[attr-defined]
        self.last_stall_s = stall = time.perf_counter() - t0
        fut.add_done_callback(self._log_failure)
        path = str(layout.step_dir(self.directory, step))
        fut.add_done_callback(lambda f: _record_commit(f, step, stall, t0, path))
        return fut

    def _save_ram(self, planned: StagingPlan, step: int) -> Future[SaveResult] | None:
        """Snapshot into the launcher's memory; None when it does not fit (then disk).

        SYNC: the copy happens now; the checksum and the commit record follow on a
        thread, and the returned Future resolves once the snapshot is committed.
        BACKGROUND: the copy runs on that thread too (one copy thread: the training
        thread keeps running), guarded like a background disk snapshot.
        """
        assert self._ram is not None
        t0 = time.perf_counter()
        self._wait_ram_commit()
        segment = self._ram
        try:
            segment.check_fits(planned)
        except SnapshotTooLargeError as exc:
            logger.error("rank %d: step %d goes to disk: %s", self.rank, step, exc)
            return None
        if self._ram_committer is None:
            self._ram_committer = ThreadPoolExecutor(1, thread_name_prefix="stalwart-ram-commit")

        def result(record: Any) -> SaveResult:
            return SaveResult(
                step=step,
                rank=self.rank,
                path=segment.path,
                nbytes=record.tensor_offset + record.tensor_bytes,
                checksum=f"xxh3_64:{record.tensor_hash:016x}",
                write_s=time.perf_counter() - t0,
                step_complete=False,
                ram_only=True,
                persisted=False,
            )

        if self.config.staging is StagingMode.BACKGROUND:
            staged_evt = threading.Event()

            def stage_and_commit() -> SaveResult:
                try:
                    staged = segment.stage(planned, step, self.rank, self.world_size, threads=1)
                    # Modified while copied: the slot stays uncommitted (never used), the
                    # previous snapshot stays the newest.
                    check_unchanged(planned)
                finally:
                    staged_evt.set()
                return result(segment.commit(staged))

            with self._lock:
                self._maybe_unstaged = True
                fut = self._ram_committer.submit(stage_and_commit)
                fut.staged = staged_evt  # type: ignore[attr-defined]
                self._track(fut)
        else:
            staged = segment.stage(
                planned,
                step,
                self.rank,
                self.world_size,
                threads=self.config.copy_threads or _default_copy_threads(),
            )
            fut = self._ram_committer.submit(lambda: result(segment.commit(staged)))
            with self._lock:
                self._track(fut)
        self._ram_commit = fut
        return fut

    def _wait_ram_commit(self) -> None:
        pending, self._ram_commit = self._ram_commit, None
        if pending is not None:
            try:
                pending.result()
            except BaseException as exc:  # reported through that save's Future
                logger.debug("previous RAM snapshot failed to commit: %s", exc)

    def restore(
        self,
        *,
        map_location: Any = "cpu",
        weights_only: bool = True,
        group: Any = None,
        timeout_s: float = 300.0,
        into: Any = None,
    ) -> Loaded | None:
        """The newest step every rank can load, from RAM where possible (collective).

        ``into``: a state dict whose tensors receive the checkpoint's in place (e.g.
        ``{"model": model.state_dict(), "optim": optimizer.state_dict()}``); see
        :func:`stalwart.checkpoint.restore`.
        """
        from .resume import restore

        if into is not None and holds_sharded(into):
            return self._restore_sharded(into, group)
        self._wait_ram_commit()
        try:
            return restore(
                self.directory,
                self.rank,
                self.world_size,
                group=group,
                map_location=map_location,
                weights_only=weights_only,
                timeout_s=timeout_s,
                threads=self.config.copy_threads or _default_copy_threads(),
                into=into,
                # Mapped since this checkpointer was built: reading the snapshot from
                # it skips mapping the segment again.
                segment=self._ram,
            )
        finally:
            if self._ram is not None:
                # Deferred while the restore read (RamSegment.__init__): the saves
                # that follow want the pages faulted in.
                self._ram.start_populating()

    def _restore_sharded(self, into: Any, group: Any) -> Loaded | None:
        from .dcp import load_newest

        self.wait()
        step = load_newest(into, self.directory, process_group=group)
        if step is None:
            return None
        return Loaded(step, into, layout.step_dir(self.directory, step))

    def _track(self, fut: Future[SaveResult]) -> None:
        self._inflight = [f for f in self._inflight if not f.done()]
        self._inflight.append(fut)

    def reserve_for(self, state_dict: Any) -> Future[None]:
        """Size the staging buffer for ``state_dict`` in the background.

        The first save otherwise pays for allocating and faulting in the
        buffer (about 0.5-1 s per GiB here); call this once after building the
        model and optimizer to move that cost off the training thread.
        """
        return self._process.reserve(plan(state_dict).used_bytes)

    def wait_staged(self) -> None:
        """Block until every snapshot taken so far has been copied out of the caller's tensors."""
        while True:
            with self._lock:
                pending = [
                    evt
                    for evt in (getattr(f, "staged", None) for f in self._inflight)
                    if evt is not None and not evt.is_set()
                ]
                if not pending:
                    self._maybe_unstaged = False
                    return
            for evt in pending:
                evt.wait()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every in-flight save; re-raise the first failure among them."""
        with self._lock:
            pending, self._inflight = self._inflight, []
        first_error: BaseException | None = None
        for fut in pending:
            exc = fut.exception(timeout)
            if exc is not None and first_error is None:
                first_error = exc
        if first_error is not None:
            raise first_error

    def close(self) -> None:
        """Finish in-flight saves (failures are logged), then stop the writer."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        except BaseException as exc:
            logger.error("a checkpoint save failed before close: %s", exc)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._sharded is not None:
            self._sharded.close()
            self._sharded = None
        if self._writer is not None:
            # Our writer has no user init function: one that never wrote has nothing to
            # finish, so a child still importing torch is not waited for.
            self._writer.close(abandon_unused_start=True)
        self._wait_ram_commit()
        if self._ram_committer is not None:
            self._ram_committer.shutdown(wait=True)
            self._ram_committer = None
        if self._ram is not None:
            self._ram.close()
            self._ram = None

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _before_optimizer_step(self, *_: Any) -> None:
        self.wait_staged()

    def _before_forward(self, *_: Any) -> None:
        if self._maybe_unstaged:
            self.wait_staged()

    def _after_optimizer_step(self, optimizer: Any, *_: Any) -> None:
        if self._saved_once or self._closed or optimizer in self._optimizer_bytes:
            return
        # Once per optimizer, after its first step: its state tensors exist now.
        self._optimizer_bytes[optimizer] = _optimizer_nbytes(optimizer)
        wanted = sum(self._optimizer_bytes.values())
        if wanted > self._auto_reserved:
            self._auto_reserved = wanted
            # Provisional: the estimate may be for more than this job saves (a
            # model-only checkpoint); the first snapshot trims what it did not use.
            self._process.reserve(wanted, provisional=True)

    @staticmethod
    def _log_failure(fut: Future[SaveResult]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            logger.error("checkpoint save failed: %s", fut.exception())


def _record_commit(fut: Future[SaveResult], step: int, stall: float, t0: float, path: str) -> None:
    """Under ``stalwart run``, a committed share goes to the run's event log (goodput
    accounting, metrics); elsewhere this does nothing."""
    if not fut.cancelled() and fut.exception() is None:
        save = time.perf_counter() - t0
        runlog.emit(runlog.CHECKPOINT_COMMIT, step=step, stall_s=stall, save_s=save, path=path)


def _optimizer_nbytes(optimizer: Any) -> int:
    """Bytes of an optimizer's parameters and state tensors (a staging estimate)."""
    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += TENSOR_ALIGN + t.numel() * t.element_size()

    for group in optimizer.param_groups:
        for p in group["params"]:
            add(p)
    for state in optimizer.state.values():
        for value in state.values():
            add(value)
    return total
