"""Whether a file found at a path we own can be trusted: the kind we expect, ours, and
(where it holds anything) closed to other users.  A pure judgement of ``lstat``'s answer;
each caller raises its own error with the sentence returned.  And how a file we own is
replaced: whole, and never through a link (``replace_file``)."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Literal

Kind = Literal["file", "folder", "fifo"]

_IS_KIND = {"file": stat.S_ISREG, "folder": stat.S_ISDIR, "fifo": stat.S_ISFIFO}


def _kind_of(mode: int) -> str:
    for name, test in _IS_KIND.items():
        if test(mode):
            return f"a {name}"
    return "a symbolic link" if stat.S_ISLNK(mode) else "another kind of file"


def untrusted(
    st: os.stat_result, kind: Kind, *, private: bool, uid: int | None = None
) -> str | None:
    """Why a file with status *st* is not to be trusted as ours, or None.

    kind: what it must be (a link is never any of them: pass ``lstat``'s answer).
    private: group and others must have no access at all (a file we read secrets or
    commands from); otherwise only kind and owner count.
    uid: the owner it must have; this process's real uid by default.
    """
    me = os.getuid() if uid is None else uid
    if not _IS_KIND[kind](st.st_mode):
        return f"expected a {kind}, found {_kind_of(st.st_mode)}"
    if st.st_uid != me:
        return f"expected one owned by uid {me}, found uid {st.st_uid}"
    if private and st.st_mode & 0o077:
        return f"expected no group/other access, found mode {stat.filemode(st.st_mode)}"
    return None


def replace_file(path: Path, data: bytes | Callable[[BinaryIO], None], mode: int = 0o600) -> None:
    """Puts a file at *path* whole or not at all, without following any link.

    The data goes to a new temporary file beside *path* (a unique name, created with
    ``O_EXCL | O_NOFOLLOW``, so nothing planted at a predictable ``.tmp`` name is written
    through), is flushed to disk, and is renamed over *path*; a link at *path* itself
    is replaced, never followed. On an error the temporary file is removed.
    *data*: the bytes, or a function that writes them to the open file.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            if isinstance(data, bytes):
                fh.write(data)
            else:
                data(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
