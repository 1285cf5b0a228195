"""Durability helpers: fsync of files and directories, atomic pointer updates.

The rename-into-place protocol is only crash safe if the data and the directory
entries reaching the disk are ordered; these helpers make that explicit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush a directory so that entries created or renamed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_symlink(link: Path, target: str) -> None:
    """Point ``link`` at ``target`` atomically (a reader sees old or new, never none)."""
    tmp = link.with_name(f".{link.name}.{uuid.uuid4().hex}.tmp")
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(link.parent)


def remove_tree(path: Path) -> None:
    """Delete a directory tree so that a half-deleted tree never keeps its name.

    Renaming first means a crash mid-delete leaves a temp-named folder, which the
    scanners ignore, instead of a step folder with files missing.
    """
    if not path.exists():
        return
    doomed = path.with_name(f".tmp-delete-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, doomed)
    except OSError:
        doomed = path
    shutil.rmtree(doomed, ignore_errors=True)
