"""One node's side of a round's collective link check: who takes part, and its process.

The round's nodes come to the check one by one (each after its own checks), so its
members are sealed once: when as many nodes came as the job can have, or when every
node that started checking came and nobody new started for `GATHER` seconds, or after
`GATHER_CAP` (``seal_now``, pure). The first node to see that writes
the signed member list; a node that comes after it is not a member and is judged by
its echo times only. The first member's check process serves the store the check's
process groups meet on and leaves its address, signed, for the others.

The check itself runs in a process of its own (``linkrun``), started when the node
starts checking so that importing torch overlaps its other checks, and killed with its
whole session at `LinkCheck`'s bound: a hung collective costs the bound, never the
launcher, and never touches the workers' process group.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Protocol

import msgspec

from stalwart.health.judge import Limits
from stalwart.health.linkrun import Orders, Serving
from stalwart.health.records import (
    ID_LIMIT,
    MAX_LINKS,
    BadRecord,
    CollectiveLinks,
    LinkPlan,
    LinkStore,
    link_coming,
    link_count,
    link_node,
    link_plan_key,
    link_store_key,
    open_link_plan,
    open_link_store,
    sign,
)
from stalwart.rendezvous import keys

logger = logging.getLogger(__name__)

#: Seconds with no newcomer after which the check's members are sealed.
GATHER = 3.0
#: Seconds a node waits for its members at most, counted from its own arrival.
GATHER_CAP = 15.0
_POLL = 0.05
# How often a wait for the check's process also looks whether the job ended.
_LINE_POLL = 0.25
_LINE_LIMIT = 512 * 1024


class Store(Protocol):
    def get(self, key: str) -> bytes | None: ...
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...
    def set(self, key: str, value: str, *, leased: bool = False) -> None: ...
    def create(self, key: str, value: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...


def seal_now(came: int, coming: int, expected: int, quiet_for: float, waited: float) -> bool:
    """Whether the check's members are complete: every node the job can have *came*,
    or every node *coming* (it started checking) came and nobody new appeared for
    `GATHER` seconds, or this node waited `GATHER_CAP`."""
    return came >= expected or (came >= coming and quiet_for >= GATHER) or waited >= GATHER_CAP


def check_key(key: bytes) -> bytes:
    """The key the check's timings are signed with (derived: the health key itself never
    leaves the launcher)."""
    return hmac.new(key, b"stalwart-links/1", hashlib.sha256).digest()


class LinkCheck:
    """This node's collective link check for one round."""

    def __init__(
        self, key: bytes, run_id: str, *, expected: int, limits: Limits, bound: float
    ) -> None:
        self._key = key
        self._run_id = run_id
        self._expected = expected
        self._limits = limits
        self._bound = bound
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: queue.Queue[bytes] = queue.Queue()
        self._err: IO[bytes] | None = None
        self._t0 = 0.0
        self._kv: Store | None = None  # the round's store, while `run` takes part

    def start(self) -> None:
        """Starts the check's process (it imports torch while the node checks itself)."""
        self._t0 = time.monotonic()
        self._err = tempfile.TemporaryFile()  # noqa: SIM115  # closed in stop()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "stalwart.health.linkrun", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            start_new_session=True,  # killed as a whole at the bound
        )
        out = self._proc.stdout
        assert out is not None

        def pump() -> None:
            for line in iter(lambda: out.readline(_LINE_LIMIT), b""):
                self._lines.put(line)
            self._lines.put(b"")  # it ended: no need to wait out the bound

        threading.Thread(target=pump, name="stalwart-linkcheck", daemon=True).start()

    def coming(self, kv: Store, round_: int) -> None:
        """Tells the round this node is checking, and will come to the link check."""
        kv.add(link_coming(round_), 1)

    def _left(self) -> float:
        """Seconds left of the bound; none once the job ended: a spare checking for a
        round that will never come leaves with the job instead of waiting it out."""
        if self._kv is not None and self._kv.get(keys.JOB_ENDED) is not None:
            return 0.0
        return self._t0 + self._bound - time.monotonic()

    def run(
        self,
        kv: Store,
        round_: int,
        node: str,
        addr: str,
        reported: Callable[[Sequence[str]], Sequence[str]],
    ) -> CollectiveLinks | None:
        """Takes part in *round_*'s check as *node*; None when it is not a member (it
        came after the members were sealed). *reported*: which of some node ids left a
        valid report for the round (a name a stranger wrote is no member)."""
        if self._proc is None:
            self.start()
        self._t0 = time.monotonic()  # the bound counts from here (started ahead: idle)
        self._kv = kv
        try:
            members = self._members(kv, round_, node, reported)
            if isinstance(members, str):
                return self._void((node,), members)
            if node not in members:
                logger.info("came after round %d's link check was sealed: echo times only", round_)
                return None
            if len(members) < 2:
                return None  # nobody to time a link to
            return self._check(kv, round_, node, members, addr)
        finally:
            self.stop()

    def _members(
        self,
        kv: Store,
        round_: int,
        node: str,
        reported: Callable[[Sequence[str]], Sequence[str]],
    ) -> tuple[str, ...] | str:
        i = kv.add(link_count(round_), 1) - 1
        kv.set(link_node(round_, i), node)
        t0 = last = time.monotonic()
        seen = (-1, -1)
        while (raw := kv.get(link_plan_key(round_))) is None:
            now = time.monotonic()
            came = min(kv.add(link_count(round_), 0), MAX_LINKS)
            coming = kv.add(link_coming(round_), 0)
            if (came, coming) != seen:
                seen, last = (came, coming), now
            if seal_now(came, coming, self._expected, now - last, now - t0):
                names = kv.get_many([link_node(round_, j) for j in range(came)])
                ids = [n.decode(errors="replace")[:ID_LIMIT] for n in names if n is not None]
                members = tuple(dict.fromkeys(reported(list(dict.fromkeys(ids)))))
                plan = LinkPlan(run_id=self._run_id, round=round_, members=members)
                kv.create(link_plan_key(round_), sign(self._key, plan))
                continue
            if self._left() <= 0:
                return "the members were not sealed within the bound"
            time.sleep(_POLL)
        try:
            return open_link_plan(self._key, raw, self._run_id, round_).members
        except BadRecord as err:
            logger.warning("the link check of round %d is off: its member list: %s", round_, err)
            return f"a bad member list: {err}"

    def _line(self) -> bytes | None:
        """The process's next line; None when it ended or its bound passed first."""
        while (left := self._left()) > 0:
            try:
                return self._lines.get(timeout=min(left, _LINE_POLL)) or None
            except queue.Empty:
                continue
        return None

    def _check(
        self, kv: Store, round_: int, node: str, members: tuple[str, ...], addr: str
    ) -> CollectiveLinks:
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        rank = members.index(node)
        store = ""
        if rank > 0:
            found = self._store_of(kv, round_)
            if found is None or found.startswith("!"):
                return self._void(members, found[1:] if found else "no store from its first member")
            store = found
        orders = Orders(
            rank=rank,
            members=members,
            host=addr,
            store=store,
            prefix=f"stalwart-links/r{round_}",
            key=check_key(self._key).hex(),
            limits=self._limits,
        )
        try:
            proc.stdin.write(msgspec.json.encode(orders) + b"\n")
            proc.stdin.flush()
        except OSError as err:  # it died while importing torch
            return self._void(members, f"its process ended early: {err}")
        if rank == 0:
            line = self._line()
            try:
                served = msgspec.json.decode(line or b"", type=Serving)
            except msgspec.DecodeError:
                return self._void(members, "its process did not serve the store")
            rec = LinkStore(run_id=self._run_id, round=round_, address=served.store)
            kv.create(link_store_key(round_), sign(self._key, rec))
        line = self._line()
        if line is None:
            return self._void(members, f"no result (it ended, or ran past {self._bound:g}s)")
        try:
            return msgspec.json.decode(line, type=CollectiveLinks)
        except msgspec.DecodeError as err:
            return self._void(members, f"not a result: {err}")

    def _store_of(self, kv: Store, round_: int) -> str | None:
        """The check's store, as its first member signed it ("!why": not to be had)."""
        while (raw := kv.get(link_store_key(round_))) is None:
            if self._left() <= 0 or self._proc is None or self._proc.poll() is not None:
                return None
            time.sleep(_POLL)
        try:
            return open_link_store(self._key, raw, self._run_id, round_).address
        except BadRecord as err:
            return f"!its store's address: {err}"

    def _void(self, members: tuple[str, ...], why: str) -> CollectiveLinks:
        err = ""
        if self._err is not None:
            self._err.seek(0)
            tail = self._err.read()[-2000:].decode(errors="replace").strip().splitlines()
            err = f" ({tail[-1][:200]})" if tail else ""
        logger.warning("the collective link check found nothing: %s%s", why, err)
        return CollectiveLinks(members=members, void=why[:400])

    def stop(self) -> None:
        """Kills the check's process and everything it started (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        if self._err is not None:
            self._err.close()
            self._err = None
