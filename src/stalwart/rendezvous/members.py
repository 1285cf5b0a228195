"""What the elastic rendezvous reads of the store about the nodes: records and liveness.

`Member` (a node that took a slot in a round) and `JobEnd` (the job's last word) are
JSON records anyone who can reach a c10d store could have written, so each is decoded
against its type and a malformed one dropped (logged once per key). `Liveness` tells
lost nodes from the nodes' keep-alive counters.
"""

from __future__ import annotations

import logging
from typing import Annotated, TypeVar

import msgspec

from stalwart.base.liveness import CounterWatch
from stalwart.rendezvous import keys
from stalwart.rendezvous.kv import KV

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Member(msgspec.Struct, frozen=True):
    id: str
    host: str
    addr: str
    nproc: Annotated[int, msgspec.Meta(ge=1)]
    hint: Annotated[int, msgspec.Meta(ge=0)] | None  # previous group rank, or --node-rank

    @classmethod
    def decode(cls, raw: bytes) -> Member:
        return msgspec.json.decode(raw, type=cls)

    def encode(self) -> str:
        return msgspec.json.encode(self).decode()


def node_name(host: str, addr: str) -> str:
    """A node as the quarantine ledger names it: its host and the address it advertises
    (simulated hosts on one machine share a host name, never an address)."""
    return f"{host}@{addr}"


class JobEnd(msgspec.Struct, frozen=True):
    succeeded: bool
    reason: str = ""
    # Bounded as the launcher's flag is: a stranger who can write the store must not make
    # a node exit 0 for a failed job, or with a code that reads as a signal.
    exit_code: Annotated[int, msgspec.Meta(ge=2, le=125)] | None = None


def decode_or_none(raw: bytes, typ: type[T], key: str, warned: set[str]) -> T | None:
    """A record from the store, or None (logged once per key) when it does not parse:
    anyone who can reach a c10d store can write to it."""
    try:
        return msgspec.json.decode(raw, type=typ)
    except msgspec.DecodeError as err:
        if key not in warned:
            warned.add(key)
            logger.warning("dropped a malformed record at %s: %s", key, err)
        return None


class Liveness:
    """This node's view of who is alive, from the nodes' heartbeat counters in the store."""

    def __init__(self, kv: KV, lost_after: float) -> None:
        self._kv = kv
        # Not looking for half the loss timeout (blocked, or the store stalled) forgives
        # the silence this node did not watch.
        self._watch = CounterWatch[str](lost_after, blind_after=lost_after / 2)

    def observe(self, ids: list[str]) -> None:
        values = self._kv.get_many([keys.heartbeat(i) for i in ids])
        self._watch.observe_many(zip(ids, values, strict=True))

    def lost(self, node: str) -> float | None:
        """Seconds since *node* last showed a sign of life, if that makes it lost."""
        return self._watch.lost(node)
