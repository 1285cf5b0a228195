"""The quarantine ledger in the job's rendezvous store: every node writes, every node reads.

After a failed round each node writes its ``Implication`` at ``r<n>/implicated/<its
node rank>`` (``rendezvous.keys``), signed with an HMAC-SHA256 under a key derived from
the job's secret and run id (the secret never passes through the store, which anyone
who reaches its port can read and write).  A reader keeps, per round, the entry of the
lowest node rank that is well formed, small, signed by the job's key and about that
round; anything else (a stranger's forgery, garbage, a replay of another round's or
another job's entry) is dropped with one logged line per key, so a stranger can at
worst hide a failure from the ledger, never quarantine a healthy node.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Protocol

import msgspec

from stalwart.health.quarantine import Implication
from stalwart.rendezvous import keys

logger = logging.getLogger(__name__)

#: The largest ledger value read back (bytes): an entry's bounded fields with room to spare.
ENTRY_LIMIT = 4096


class LedgerStore(Protocol):
    """What the ledger needs of the job's store (a rendezvous ``KV``)."""

    def get_many(self, keys: list[str]) -> list[bytes | None]: ...

    def set(self, key: str, value: str, *, leased: bool = False) -> None: ...


class Signed(msgspec.Struct, frozen=True):
    entry: Implication
    mac: str


def ledger_key(secret: bytes, run_id: str) -> bytes:
    """The ledger's key: the job's secret bound to this job (and to this use of it)."""
    return hmac.new(secret, b"stalwart-quarantine/1\0" + run_id.encode(), hashlib.sha256).digest()


def _mac(key: bytes, entry: Implication) -> str:
    return hmac.new(key, msgspec.json.encode(entry), hashlib.sha256).hexdigest()


def seal(key: bytes, entry: Implication) -> bytes:
    return msgspec.json.encode(Signed(entry, _mac(key, entry)))


def unseal(key: bytes, raw: bytes, round_: int) -> Implication:
    """The entry in *raw*, written for round *round_* by a node of the job; a
    ``ValueError`` (one line) otherwise."""
    if len(raw) > ENTRY_LIMIT:
        raise ValueError(f"a value of {len(raw)} bytes (the limit is {ENTRY_LIMIT})")
    try:
        signed = msgspec.json.decode(raw, type=Signed)
    except msgspec.DecodeError as err:
        raise ValueError(f"not a ledger entry: {err}") from None
    if not hmac.compare_digest(signed.mac.encode(), _mac(key, signed.entry).encode()):
        raise ValueError("its MAC does not match: not written by a node of this job")
    if signed.entry.round != round_:
        raise ValueError(f"an entry of round {signed.entry.round}, not of round {round_}")
    return signed.entry


class Ledger:
    """This node's door to the job's ledger."""

    def __init__(self, kv: LedgerStore, key: bytes, max_nodes: int) -> None:
        self._kv = kv
        self._key = key
        self._max_nodes = max_nodes
        self._warned: set[str] = set()
        self._read: dict[int, Implication] = {}  # rounds whose entry is settled

    def write(self, node_rank: int, entry: Implication) -> None:
        self._kv.set(keys.Round(entry.round).implicated(node_rank), seal(self._key, entry).decode())

    def read(self, rounds: int) -> list[Implication]:
        """The entries of rounds ``0 .. rounds - 1`` (one per round that has one)."""
        todo = [r for r in range(rounds) if r not in self._read]
        names = [keys.Round(r).implicated(n) for r in todo for n in range(self._max_nodes)]
        values = self._kv.get_many(names) if names else []
        for i, r in enumerate(todo):
            for n in range(self._max_nodes):
                raw = values[i * self._max_nodes + n]
                if raw is None:
                    continue
                try:
                    self._read[r] = unseal(self._key, raw, r)
                    break
                except ValueError as err:
                    name = names[i * self._max_nodes + n]
                    if name not in self._warned:
                        self._warned.add(name)
                        logger.warning("quarantine ledger: dropped the value at %s: %s", name, err)
        return [self._read[r] for r in sorted(self._read) if r < rounds]

    def read_all(self, chunk: int = 16) -> list[Implication]:
        """Every entry of the job so far, for a launcher that has not run a round yet
        (a spare, or a node's launcher started again): rounds are read *chunk* at a time
        until a chunk holds none."""
        r = 0
        while True:
            entries = self.read(r + chunk)
            if not any(e.round >= r for e in entries):
                return entries
            r += chunk
