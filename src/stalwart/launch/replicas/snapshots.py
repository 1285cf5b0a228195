"""The launcher's memory for checkpoint snapshots (``stalwart run --ckpt-ram SIZE``).

Workers copy snapshots into segments the launcher owns, so a snapshot outlives the worker
that took it: a restarted worker, warm or cold, restores from it without reading the disk.
The launcher creates a private folder (0700) in ``/dev/shm`` with one segment per local
rank (0600, two snapshot slots of ``SIZE`` each; the format is ``stalwart.checkpoint.
ramlayout``), reserves all of it at start-up (so running out of memory is an error here,
in one line, never at a save), and removes it when it exits. Should the launcher be
SIGKILLed, the guardian removes the folder (it is registered like the monitor's); should
both be, the next launcher on the host removes folders whose owner is gone.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from stalwart.checkpoint import ramlayout as rl
from stalwart.config import ConfigError

logger = logging.getLogger(__name__)

FOLDER_PREFIX = "stalwart-ckpt-"
OWNER_FILE = "owner.json"
# A folder without an owner file younger than this may be a launcher's being set up.
_ORPHAN_GRACE_S = 60.0


class SnapshotMemoryError(ConfigError):
    """The snapshot memory cannot be reserved; the message is one line."""


def default_base() -> Path:
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


def is_stale(
    owner: tuple[int, float] | None,
    age_s: float,
    started_at: Callable[[int], float | None],
) -> bool:
    """Whether a snapshot folder outlived its launcher.

    ``owner``: (pid, process start time) from its owner file, None when absent or
    unreadable; ``started_at(pid)``: the start time of the live process ``pid``, or None.
    """
    if owner is None:
        return age_s > _ORPHAN_GRACE_S
    pid, start = owner
    alive = started_at(pid)
    return alive is None or abs(alive - start) > 1e-3


def _started_at(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return None


def _read_owner(folder: Path) -> tuple[int, float] | None:
    try:
        data = json.loads((folder / OWNER_FILE).read_text())
        return int(data["pid"]), float(data["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def sweep_stale(base: Path) -> list[Path]:
    """Remove this user's snapshot folders whose launcher is gone; returns them."""
    removed: list[Path] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(FOLDER_PREFIX):
            continue
        try:
            st = entry.lstat()
        except OSError:
            continue
        if st.st_uid != os.getuid() or not entry.is_dir() or entry.is_symlink():
            continue
        if is_stale(_read_owner(entry), now - st.st_mtime, _started_at):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            logger.info("removed checkpoint snapshot memory left by a dead launcher: %s", entry)
    return removed


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


class SnapshotMemory:
    """One per launcher: the segments of its local ranks, reserved once."""

    def __init__(self, nproc: int, slot_bytes: int, *, base: Path | None = None) -> None:
        if nproc < 1 or slot_bytes < rl.PAGE:
            raise SnapshotMemoryError(
                f"--ckpt-ram {slot_bytes}: expected at least {rl.PAGE} bytes per rank"
            )
        base = Path(base) if base is not None else default_base()
        sweep_stale(base)
        self.slot_bytes = slot_bytes
        self._nproc = nproc
        self.segment_bytes = rl.segment_bytes(slot_bytes)
        wanted = nproc * self.segment_bytes
        what = f"--ckpt-ram {_size(slot_bytes)}"
        try:
            st = os.statvfs(base)
            free = st.f_bavail * st.f_frsize
        except OSError as exc:
            raise SnapshotMemoryError(f"{what}: cannot use {base}: {exc.strerror}") from None
        why = rl.room_error(wanted, free, psutil.virtual_memory().available, str(base))
        if why is not None:
            raise SnapshotMemoryError(
                f"{what}: {why} ({nproc} local ranks x {rl.GENERATIONS} snapshots); "
                "lower --ckpt-ram or free memory"
            )
        self.folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=base))
        try:
            (self.folder / OWNER_FILE).write_text(
                json.dumps({"pid": os.getpid(), "start": _started_at(os.getpid())})
            )
            for lr in range(nproc):
                self._create(self.folder / rl.segment_name(lr), what)
        except BaseException:
            self.close()
            raise
        logger.info(
            "checkpoint snapshot memory: %s for %d local ranks in %s",
            _size(wanted),
            nproc,
            self.folder,
        )

    def _create(self, path: Path, what: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            no_room = reserve(fd, self.segment_bytes)
        finally:
            os.close(fd)
        if no_room is not None:
            raise SnapshotMemoryError(
                f"{what}: cannot reserve {_size(self.segment_bytes)} in {path.parent} "
                f"({no_room}); lower --ckpt-ram or free memory"
            )

    def repair(self) -> list[tuple[str, str]]:
        """Make anew each local segment that is no longer what ``_create`` made (cut
        short, extended, replaced by something else): a worker could not map it, and
        reading one past its end is a SIGBUS. Returns (name, what was wrong) for each.
        Called between rounds, while no worker of this node runs."""
        fixed: list[tuple[str, str]] = []
        for lr in range(self._nproc):
            path = self.folder / rl.segment_name(lr)
            try:
                st = path.lstat()
                problem = (
                    "not a regular file"
                    if not stat.S_ISREG(st.st_mode)
                    else f"{st.st_size} bytes, {self.segment_bytes} expected"
                    if st.st_size != self.segment_bytes
                    else ""
                )
            except FileNotFoundError:
                problem = "missing"
            if not problem:
                continue
            logger.warning(
                "snapshot segment %s is damaged (%s): its snapshots are lost; making it anew",
                path,
                problem,
            )
            tmp = path.with_name(f".{path.name}.new")
            tmp.unlink(missing_ok=True)
            try:
                self._create(tmp, f"--ckpt-ram {_size(self.slot_bytes)}")
            except (OSError, SnapshotMemoryError) as exc:
                tmp.unlink(missing_ok=True)
                logger.warning("cannot make %s anew: %s", path, exc)
                continue
            os.replace(tmp, path)
            fixed.append((path.name, problem))
        return fixed

    def worker_env(self) -> dict[str, str]:
        return {rl.RAM_DIR_ENV: str(self.folder)}

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def reserve(fd: int, nbytes: int) -> str | None:
    """Sizes the open file `fd` to `nbytes`, booking (on tmpfs: allocating) every page
    now, so that out of memory shows here and not as a SIGBUS in a worker's first save.
    Returns why when there is no room (the file is then left as it was), else None."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            return exc.strerror or errno.errorcode.get(exc.errno or 0, "no room")
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        # A file system without fallocate: sized, pages come at first touch.
        os.ftruncate(fd, nbytes)
    return None
