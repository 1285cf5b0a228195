"""Values a stranger cannot forge: an HMAC by a key derived from the job's secret.

The job's stores (the rendezvous ``TCPStore``, the workers' store) have no
authentication: anyone who reaches their port can read and write every key. A value
that steers the job is therefore written *sealed* (a MAC over the key's name and the
value, by a key only the job's nodes hold) and opened on the way back; a value whose
MAC is missing or wrong is a stranger's and is refused. The name is part of the MAC, so
a genuine value cannot be moved to another key (another node's record, another round).

The key is derived from the job's secret (``config.secret``) and the run id, with a
label per use, so that two jobs sharing a secret, or two uses within one job, cannot
replay each other's values.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from pathlib import Path

from stalwart.base import envvars
from stalwart.base.files import replace_file, untrusted

#: The use the workers' key is derived for: the in-process wrapper's records.
WORKER_LABEL = "stalwart-inprocess/1"
#: Largest sealed value accepted back (bytes); the largest record the job writes (a
#: failure record, bounded to 256 KiB) fits with room to spare.
VALUE_LIMIT = 512 * 1024
_TAG = b"hmac1:"
_HEX = 64


class SealError(ValueError):
    """A value that is not one of the job's: the message says why (one line)."""


def derive_key(secret: bytes, label: str, run_id: str) -> bytes:
    """A key for one use (*label*) in one job, from the job's secret."""
    return hmac.new(secret, label.encode() + b"\0" + run_id.encode(), hashlib.sha256).digest()


def mac_ok(got: str, want: str) -> bool:
    return hmac.compare_digest(got.encode(), want.encode())


class Seal:
    """Seals the values written under a name and opens those read back.

    Without a key (a multi-node job given no secret) values pass as they are, still
    bounded in size: the store is then as open as torchrun's, which the launcher says
    once at its start."""

    def __init__(self, key: bytes | None, label: str) -> None:
        self._key = key
        self._label = label.encode()

    @property
    def keyed(self) -> bool:
        return self._key is not None

    def _mac(self, name: str, value: bytes) -> bytes:
        assert self._key is not None
        msg = self._label + b"\0" + name.encode() + b"\0" + value
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest().encode()

    def close(self, name: str, value: bytes) -> bytes:
        """*value* as it is written under *name*."""
        if self._key is None:
            return value
        return _TAG + self._mac(name, value) + b":" + value

    def open(self, name: str, raw: bytes) -> bytes:
        """The value written under *name*; ``SealError`` when it is not the job's."""
        if len(raw) > VALUE_LIMIT + len(_TAG) + _HEX + 1:
            raise SealError(f"a value of {len(raw)} bytes (the limit is {VALUE_LIMIT})")
        if self._key is None:
            return raw
        if not raw.startswith(_TAG) or raw[len(_TAG) + _HEX : len(_TAG) + _HEX + 1] != b":":
            raise SealError("a value without the job's MAC (not written by a node of this job)")
        got = raw[len(_TAG) : len(_TAG) + _HEX]
        value = raw[len(_TAG) + _HEX + 1 :]
        if not hmac.compare_digest(got, self._mac(name, value)):
            raise SealError(
                "a value with a wrong MAC (not written by a node of this job, or the "
                "nodes' job secrets differ)"
            )
        return value


def write_worker_key(folder: Path, secret: bytes, run_id: str) -> dict[str, str]:
    """Puts the workers' key (derived: it opens nothing but their records) in a 0600
    file in *folder* (the launcher's private one); returns the variable naming it."""
    path = folder / "worker.key"
    replace_file(path, derive_key(secret, WORKER_LABEL, run_id).hex().encode(), mode=0o600)
    return {envvars.WORKER_KEY_FILE: str(path)}


def worker_seal(environ: Mapping[str, str]) -> Seal:
    """The seal a worker's in-process records carry: the launcher's key when it gave
    one, else none (plain torchrun). ``ValueError`` (one line) for a key file that is
    not the launcher's: ranks that disagree on the key could not read each other."""
    where = environ.get(envvars.WORKER_KEY_FILE)
    if not where:
        return Seal(None, WORKER_LABEL)
    what = f"{envvars.WORKER_KEY_FILE}={where}"
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        raise ValueError(f"{what}: {err.strerror}; expected the launcher's key file") from None
    try:
        problem = untrusted(os.fstat(fd), "file", private=True)
        if problem:
            raise ValueError(f"{what}: {problem}")
        raw = os.read(fd, 129)
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(raw.decode("ascii"))
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ValueError(f"{what}: expected 64 hex digits, found {len(raw)} bytes")
    return Seal(key, WORKER_LABEL)
