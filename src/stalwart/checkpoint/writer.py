"""The default writer, run inside the writer subprocess: one ``torch.save`` file
per rank, written to a temporary folder, checksummed, fsync'd and renamed into
the step folder; then the ``latest`` pointer and retention are updated.

Commit order for rank r of step S (each arrow is ordered by an fsync):

1. The data file gets a name not present in ``step_S/`` (``rank_r.pt``, or
   ``rank_r.<token>.pt`` when that is taken: a re-save). ``<root>/.tmp-step_S-
   rank_r-<token>/`` gets the data file and its manifest (which names it),
   both fsync'd, then the folder itself is fsync'd.
2. If ``step_S/`` does not exist yet, the temp folder is renamed to it (one
   atomic rename). Otherwise the data file is renamed in beside any older one
   (fsync), then the manifest replaces this rank's old one with one atomic
   rename (fsync): that rename is the switch. Only then is the data file the
   old manifest named deleted. The new file then gets the plain name back by
   the same moves: a hard link ``rank_r.pt`` (fsync), a manifest naming it
   replaces the previous one (fsync), the fresh name is unlinked.
3. The root is fsync'd; if every rank's manifest is now present, ``latest`` is
   repointed (symlink replace) and steps older than the ``keep_last`` newest
   complete ones are deleted.

At every point a complete step stays complete: this rank's manifest is always
present and names a data file that is present. A kill leaves at most a temp
folder (never the only copy of anything) and a data file no manifest names;
the next writer of this rank deletes both when it starts.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import msgspec
import torch

from . import layout
from .errors import CheckpointCorruptError, CheckpointError
from .fsio import fsync_dir, remove_tree, replace_symlink, write_file_durably
from .manifest import FORMAT_VERSION, FileEntry, Manifest, encode, new_hasher, read_manifest
from .streaming import DIRECT_ALIGN, ChunkPool, open_output

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveResult:
    """What a completed save wrote."""

    step: int
    rank: int
    path: Path
    nbytes: int
    checksum: str
    write_s: float
    step_complete: bool
    # Seconds spent per phase in the writer: serialize, hash_tail, fsync, commit.
    phases: dict[str, float] = field(default_factory=dict)
    # True when the file was written with O_DIRECT (see streaming.DirectStream).
    direct_io: bool = False
    # Bytes of it written straight from the shared buffer, without a copy.
    zero_copy_bytes: int = 0
    # True for a snapshot kept only in the launcher's memory (persist_every skipped the
    # disk): ``path`` is the segment, ``write_s`` the copy into it.
    ram_only: bool = False
    # False for a save persist_every skipped and nothing kept (no launcher memory).
    persisted: bool = True


class TorchFileWriter:
    """Writes rank ``rank``'s file of a step; built by the writer subprocess."""

    def __init__(
        self,
        root: str,
        rank: int,
        world_size: int,
        keep_last: int | None,
        algorithm: str,
        direct_io: bool = True,
    ) -> None:
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep_last = keep_last
        self.algorithm = algorithm
        # Our manifest checksum covers the whole file; torch's per-record zip
        # CRC would double the hashing cost. torch.load does not need it.
        with contextlib.suppress(AttributeError):
            torch.serialization.set_crc32_options(False)
        self.root.mkdir(parents=True, exist_ok=True)
        # Built (and its pages faulted in) while the writer starts, not in a save.
        self._pool = ChunkPool() if direct_io else None
        self._retention_due = False
        self._clean_stale_tmp()

    def _clean_stale_tmp(self) -> None:
        # Left behind by an earlier writer of this rank that was killed mid-save.
        # A temp folder never holds the only copy of a committed share: its
        # manifest is renamed out of it last, and the folder is then dropped.
        for stale in self.root.glob(layout.tmp_glob_for_rank(self.rank)):
            logger.info("removing abandoned %s", stale)
            shutil.rmtree(stale, ignore_errors=True)
        for stale in self.root.glob(f"{layout.TMP_PREFIX}delete-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for step in layout.list_steps(self.root):
            self._drop_unnamed_data(layout.step_dir(self.root, step))

    def _drop_unnamed_data(self, folder: Path) -> None:
        """Delete this rank's data files in ``folder`` that its manifest does not name.

        Such a file is a re-save cut short before its switch, or the old data
        after it. With a manifest we cannot read, nothing is deleted: that
        file may be readable again later (and then names one of them).
        """
        try:
            names = {p.name for p in folder.iterdir()}
        except OSError:
            return
        ours = {n for n in names if layout.is_data_name(n, self.rank)}
        if not ours:
            return
        try:
            named = set(read_manifest(folder / layout.manifest_name(self.rank)).files)
        except CheckpointCorruptError as exc:
            if layout.manifest_name(self.rank) in names:
                logger.debug("leaving %s alone: %s", folder, exc)
                return
            named = set()  # never committed: no manifest vouches for any of them
        for name in sorted(ours - named):
            logger.info("removing unreferenced %s", folder / name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / name)

    def write(
        self,
        state_dict: Any,
        path: str,
        *,
        release: Callable[[], None],
        **kwargs: Any,
    ) -> SaveResult:
        """Write one rank's share of a step; ``kwargs``: ``step`` (int), ``metadata`` (dict)."""
        t0 = time.monotonic()
        phases: dict[str, float] = {}
        step = int(kwargs["step"])
        metadata: dict[str, Any] | None = kwargs.get("metadata")
        final = Path(path)
        root = final.parent
        token = uuid.uuid4().hex[:12]
        tmp = root / layout.tmp_dir_name(step, self.rank, token)
        data_name = layout.next_data_name(self.rank, _names_in(final), token)
        manifest_name = layout.manifest_name(self.rank)
        try:
            tmp.mkdir(parents=True)
            hasher = new_hasher(self.algorithm)
            out = open_output(str(tmp / data_name), hasher, self._pool)
            direct = out.direct
            zero_copy = 0
            try:
                with _storage_alignment(_pick_alignment(state_dict) if direct else None):
                    torch.save(state_dict, cast(IO[bytes], out))
                phases["serialize"] = time.monotonic() - t0
                hashed = out.finish()
                zero_copy = getattr(out, "zero_copy_bytes", 0)
                # Every byte is on its way to the file (direct writes read from
                # the shared buffer until now): the parent may reuse it.
                release()
                phases["hash_tail"] = time.monotonic() - t0 - phases["serialize"]
                t1 = time.monotonic()
                os.fsync(out.fileno())
                phases["fsync"] = time.monotonic() - t1
            finally:
                out.close()
            if hashed != out.size:
                raise CheckpointError(f"hashed {hashed} bytes of {out.size} written")
            digest = hasher.hexdigest()
            manifest = Manifest(
                format=FORMAT_VERSION,
                step=step,
                rank=self.rank,
                world_size=self.world_size,
                files={data_name: FileEntry(out.size, digest, self.algorithm)},
                created_unix=time.time(),
                metadata=dict(metadata or {}),
            )
            t1 = time.monotonic()
            write_file_durably(tmp / manifest_name, encode(manifest))
            fsync_dir(tmp)
            data_name = self._commit(tmp, final, data_name, manifest)
            phases["commit"] = time.monotonic() - t1
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            os_error = _find_os_error(exc)
            if os_error is None:
                raise
            # torch.save may wrap our sink's OSError; name the real cause.
            raise CheckpointError(
                f"saving step {step} of rank {self.rank} under {root} failed: "
                f"{os_error.strerror or os_error} (errno {os_error.errno}); "
                "the previous checkpoint is untouched"
            ) from exc
        complete = layout.is_complete(final, self.world_size)
        if complete:
            try:
                self._advance_latest(root, step)
            except OSError as exc:
                # The step is durable and loaders scan folders, not the pointer:
                # failing the save here would report a good checkpoint as lost.
                logger.warning("step %d saved but `latest` not moved: %s", step, exc)
            self._retention_due = True
        return SaveResult(
            step=step,
            rank=self.rank,
            path=final / data_name,
            nbytes=out.size,
            checksum=f"{self.algorithm}:{digest}",
            write_s=time.monotonic() - t0,
            step_complete=complete,
            phases=phases,
            direct_io=direct,
            zero_copy_bytes=zero_copy,
        )

    def housekeeping(self) -> None:
        """Delete old steps; the child runs this after reporting the save done,
        so deleting a large old checkpoint never delays the caller's Future."""
        if self._retention_due and self.keep_last:
            self._retention_due = False
            self._retain(self.root)

    def _commit(self, tmp: Path, final: Path, data_name: str, manifest: Manifest) -> str:
        """Move the share in; return the data file's final name."""
        manifest_name = layout.manifest_name(self.rank)
        try:
            os.rename(tmp, final)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # Another rank, or an earlier save of this step, owns the folder.
            # data_name is new there, so the share the current manifest names
            # stays whole until the manifest rename below replaces it.
            try:
                before = set(read_manifest(final / manifest_name).files)
            except CheckpointCorruptError:
                before = set()
            os.rename(tmp / data_name, final / data_name)
            fsync_dir(final)
            os.replace(tmp / manifest_name, final / manifest_name)
            fsync_dir(final)
            for old in sorted(before - {data_name}):
                if layout.is_data_name(old, self.rank):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(final / old)
            data_name = self._settle_plain_name(tmp, final, data_name, manifest)
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_dir(final.parent)
        return data_name

    def _settle_plain_name(self, tmp: Path, final: Path, data_name: str, manifest: Manifest) -> str:
        """After a re-save, give the data file its plain name ``rank_r.pt`` back.

        ``<dir>/latest/rank_0.pt`` is what plain ``torch.load`` users open. Same
        switch as the re-save: a hard link under the plain name (nothing names
        that name now), then a second manifest naming it replaces the first, then
        the fresh name goes. A kill in between leaves the fresh name in use.
        """
        plain = layout.data_name(self.rank)
        if data_name == plain:
            return data_name
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(final / plain)
            os.link(final / data_name, final / plain)
        except OSError as exc:
            # No hard links on this file system: the fresh name stays; the
            # manifest names it, so loading is unaffected.
            logger.debug("keeping %s under %s: %s", data_name, final, exc)
            return data_name
        fsync_dir(final)
        entry = manifest.files[data_name]
        renamed = msgspec.structs.replace(manifest, files={plain: entry})
        manifest_name = layout.manifest_name(self.rank)
        write_file_durably(tmp / manifest_name, encode(renamed))
        os.replace(tmp / manifest_name, final / manifest_name)
        fsync_dir(final)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(final / data_name)
        return plain

    def _advance_latest(self, root: Path, step: int) -> None:
        current = layout.read_latest(root)
        if current is not None and current > step:
            return
        replace_symlink(root / layout.LATEST, layout.step_dir_name(step))

    def _retain(self, root: Path) -> None:
        assert self.keep_last is not None
        complete = [
            s
            for s in layout.list_steps(root)
            if layout.is_complete(layout.step_dir(root, s), self.world_size)
        ]
        if len(complete) <= self.keep_last:
            return
        oldest_kept = complete[self.keep_last - 1]
        for s in layout.list_steps(root):
            if s < oldest_kept:
                logger.info("retention: deleting step %d", s)
                remove_tree(layout.step_dir(root, s))


def _names_in(folder: Path) -> set[str]:
    try:
        return {p.name for p in folder.iterdir()}
    except FileNotFoundError:
        return set()


def _pick_alignment(state: Any) -> int | None:
    """Block-align storage records in the file when that costs at most ~1.6 %.

    Aligned records start at the same offset modulo the block size as the
    page-aligned staged tensors, so the writer sends them to disk with O_DIRECT
    without copying. Padding is up to one block per tensor: worth it for a few
    large tensors, not for a multitude of small ones.
    """
    count, nbytes = 0, 0
    seen: set[int] = set()
    stack = [state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:
                seen.add(id(obj))
                count += 1
                nbytes += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple):
            stack.extend(obj)
    if count and count * DIRECT_ALIGN * 64 <= nbytes:
        return DIRECT_ALIGN
    return None


@contextlib.contextmanager
def _storage_alignment(alignment: int | None) -> Iterator[None]:
    save_config: Any = None
    with contextlib.suppress(ImportError):
        from torch.utils.serialization import config

        save_config = config.save
    if alignment is None or not hasattr(save_config, "storage_alignment"):
        yield  # older torch: records stay 64-aligned and are copied, still correct
        return
    previous = save_config.storage_alignment
    save_config.storage_alignment = alignment
    try:
        yield
    finally:
        save_config.storage_alignment = previous


def _find_os_error(exc: BaseException) -> OSError | None:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None
