"""The job's secret: what proves a node is of this job to another (RAM replicas).

It never passes through the job's store (which has no authentication): every node gets
it out of band, from the scheduler or the user, as ``STALWART_JOB_SECRET`` (the secret
itself) or ``--job-secret-file PATH`` (``STALWART_JOB_SECRET_FILE``; a file holding it,
e.g. a Kubernetes secret volume). A job of one node needs none: its launcher draws one
and keeps it to itself.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from stalwart.config.values import ConfigError

#: The secret itself, for schedulers that hand secrets out as variables.
JOB_SECRET_ENV = "STALWART_JOB_SECRET"
MIN_BYTES = 16
MAX_BYTES = 4096


def _checked(raw: bytes, where: str) -> bytes:
    secret = raw.strip()
    if not MIN_BYTES <= len(secret) <= MAX_BYTES:
        raise ConfigError(
            f"{where}: a job secret of {len(secret)} bytes; expected {MIN_BYTES} to "
            f"{MAX_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    return secret


def read_secret_file(path: Path) -> bytes:
    """The secret in ``path``; a ``ConfigError`` (one line) when it is not a good one."""
    where = f"--job-secret-file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror}; expected a readable file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where}: not a regular file")
        if st.st_uid not in (os.getuid(), 0) or st.st_mode & 0o022:
            raise ConfigError(
                f"{where}: another user can write it (owner uid {st.st_uid}, mode "
                f"{stat.filemode(st.st_mode)}); expected one only you or root can change"
            )
        raw = os.read(fd, MAX_BYTES + 2)
    finally:
        os.close(fd)
    return _checked(raw, where)


def job_secret(path: Path | None, environ: Mapping[str, str]) -> bytes | None:
    """The job's secret given to this node, or None when none was."""
    if path is not None:
        return read_secret_file(path)
    value = environ.get(JOB_SECRET_ENV)
    if value:
        return _checked(value.encode(), JOB_SECRET_ENV)
    return None


def launcher_secret(path: Path | None, environ: Mapping[str, str], *, multi_node: bool) -> bytes:
    """The secret this launcher uses: the one given, else (one node) a fresh one."""
    given = job_secret(path, environ)
    if given is not None:
        return given
    if multi_node:
        raise ConfigError(missing_secret())
    return secrets.token_bytes(32)


def node_secret(path: Path | None, environ: Mapping[str, str], *, multi_node: bool) -> bytes | None:
    """The secret that seals this job's store records: the one given; else a fresh one
    for a job of one node (its store is its own); else None (a multi-node job given no
    secret: its store is as open as torchrun's)."""
    given = job_secret(path, environ)
    if given is not None or multi_node:
        return given
    return secrets.token_bytes(32)


def worker_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """*environ* without the job's secret: the user's program (and whatever it starts,
    prints or dumps) never needs it; the launcher keeps it in memory."""
    return {k: v for k, v in environ.items() if k != JOB_SECRET_ENV}


def unauthenticated_store() -> str:
    return (
        "no job secret: the records in this job's rendezvous store carry no MAC, so "
        "anyone who reaches its port can read them and forge a failure or the job's end "
        f"(as with torchrun); set {JOB_SECRET_ENV} or --job-secret-file PATH on every node"
    )


def missing_secret() -> str:
    return (
        "RAM snapshot replicas between nodes need a job secret the nodes share: set "
        f"{JOB_SECRET_ENV} or --job-secret-file PATH on every node (or --ckpt-replicas 0)"
    )
