"""Exception types raised by the checkpoint package.

Everything a caller may want to catch specifically derives from
:class:`CheckpointError`, so ``except CheckpointError`` covers the package.
It is a ``RuntimeError``, which is what torch's experimental checkpoint process
raises, so code written against that catches stalwart's failures unchanged.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class for checkpoint failures."""


class WriterDiedError(CheckpointError):
    """The writer subprocess exited while it owed us an answer."""


class WriterError(CheckpointError):
    """The writer subprocess raised; the message carries its traceback.

    ``remote_type`` is the qualified name of the exception class in the child and
    ``errno`` its ``errno`` when it was an ``OSError`` (e.g. ``errno.ENOSPC``), so
    callers can react to a full disk without parsing text.
    """

    def __init__(
        self,
        message: str,
        *,
        remote_type: str = "",
        errno: int | None = None,
        remote_traceback: str = "",
    ) -> None:
        detail = message
        if remote_traceback:
            detail = f"{message}\n\nTraceback in the writer process:\n{remote_traceback}"
        super().__init__(detail)
        self.remote_type = remote_type
        self.errno = errno
        self.remote_traceback = remote_traceback


class CheckpointCorruptError(CheckpointError):
    """A checkpoint on disk is missing pieces or fails its checksum."""


class StagingConflictError(CheckpointError):
    """A tensor was modified in place while it was being copied in the background."""
