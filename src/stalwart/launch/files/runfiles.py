"""The run folder ``<log_dir>/<run_id>`` and the launcher's files in it, made safe to
create under a log root that other users can write to.

The folder is created 0700 and opened without following a link; one that exists must
belong to this user.  Files are opened with ``O_NOFOLLOW``, so a link planted where a
run file goes (``events.jsonl``, ``template.log``) is refused, never written through.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# Appended to, never followed, and not inherited by workers.
APPEND_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC


class RunFolderError(OSError):
    """The run folder or one of its files cannot be used safely (a one-line message)."""


def check_component(run_id: str) -> None:
    """The run id names a folder: it must be one path component."""
    if not run_id or run_id in (".", "..") or "/" in run_id or "\0" in run_id:
        raise RunFolderError(
            f"--rdzv-id {run_id!r}: expected a name without '/' (it names the run folder)"
        )


def make_run_dir(base: Path, run_id: str) -> Path:
    """Creates (or reopens) ``base/run_id``: a real folder of this user, mode 0700."""
    check_component(run_id)
    path = base / run_id
    try:
        base.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if os.path.islink(path):
            raise RunFolderError(
                f"run folder {path} is a symbolic link; refusing to follow it "
                "(remove it, or choose another --log-dir or --rdzv-id)"
            ) from None
        raise RunFolderError(f"cannot create the run folder {path}: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise RunFolderError(
                f"run folder {path} belongs to uid {st.st_uid}, not to this user "
                f"(uid {os.geteuid()}); choose another --log-dir or --rdzv-id"
            )
        if stat.S_IMODE(st.st_mode) != 0o700:
            # A folder of ours from an earlier run: nobody else gets to write into it.
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def open_append(path: Path, mode: int = 0o600) -> int:
    """An append-only descriptor for a run file; a link at *path* is an error."""
    try:
        return os.open(path, APPEND_FLAGS, mode)
    except OSError as err:
        if os.path.islink(path):
            raise RunFolderError(
                f"{path} is a symbolic link; refusing to write through it"
            ) from None
        raise RunFolderError(f"cannot open {path}: {err.strerror}") from None
