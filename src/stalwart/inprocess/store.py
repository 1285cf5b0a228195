"""Coordination through the wrapper's key-value store: key layout, barriers and records.

Every key lives under one prefix, and everything per-iteration under
``it{n}/``, so iterations never read each other's state.  Ranks are named by
their *initial* rank.  Values are JSON or decimal text, never pickles.  The
torch store client is not used with ``wait(timeout)`` because a timed-out wait
leaves a TCPStore client connection unusable (measured on torch 2.13); waiting
is done by polling ``check``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from torch._C._distributed_c10d import FileStore as FileStore  # NVIDIA's path to it
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch.distributed import DistNetworkError

from stalwart.base import envvars
from stalwart.base.liveness import CounterWatch
from stalwart.base.sealed import WORKER_LABEL, Seal, SealError

from .errors import BarrierTimeout
from .state import InterruptionRecord

log = logging.getLogger(__name__)

PREFIX = "stalwart/inprocess/"
# Set by the wrapper while it runs: the environment no longer describes the launcher.
#: The wrapper's iteration, exported while the wrapped function runs.
ITERATION_ENV = "STALWART_INPROCESS_ITERATION"
_HOSTED: dict[tuple[str, int], Store] = {}
_POLL_MIN = 0.002
_POLL_MAX = 0.02
#: Largest record read back (an interruption record cuts its message to 2,000 chars).
RECORD_LIMIT = 16 * 1024


def parse_port(raw: bytes) -> int | None:
    """A port as published (decimal, 1..65535), or None for anything else: anyone who
    reaches the store can write the key, and a forged port steers a rank elsewhere."""
    if not 1 <= len(raw) <= 5 or not raw.isdigit():
        return None
    port = int(raw)
    return port if 0 < port < 65536 else None


def parse_interruption(raw: bytes, iteration: int) -> InterruptionRecord:
    """An interruption record of *iteration*; ``ValueError`` (one line) for anything else."""
    if len(raw) > RECORD_LIMIT:
        raise ValueError(f"a record of {len(raw)} bytes (the limit is {RECORD_LIMIT})")
    try:
        record = InterruptionRecord.from_json(raw)
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise ValueError(f"not an interruption record ({type(err).__name__}: {err})") from None
    if record.iteration != iteration or record.rank < 0:
        raise ValueError(
            f"rank {record.rank} of iteration {record.iteration} under iteration {iteration}"
        )
    return record


def parse_gone(raw: bytes, participants: Iterable[int]) -> frozenset[int]:
    """The ranks a barrier's ``done`` record names, kept to its participants."""
    if len(raw) > RECORD_LIMIT:
        raise ValueError(f"a record of {len(raw)} bytes (the limit is {RECORD_LIMIT})")
    try:
        ranks = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise ValueError(f"not a list of ranks ({err})") from None
    if not isinstance(ranks, list) or not all(type(r) is int for r in ranks):
        raise ValueError("not a list of ranks")
    return frozenset(ranks) & frozenset(participants)


def tcp_store(
    *,
    is_host: bool,
    host: str | None = None,
    port: int | None = None,
    timeout: float | datetime.timedelta = 300.0,
    host_name: str | None = None,
) -> Store:
    """The default store factory.

    * Under a torchrun agent that shares its store with workers
      (``TORCHELASTIC_USE_AGENT_STORE=True``): a client of that store, under a
      per-attempt prefix.  It lives in the agent, so it outlives any rank.
    * Otherwise: a ``TCPStore`` hosted by initial rank 0 on
      ``STALWART_INPROCESS_PORT`` or ``MASTER_PORT``.  Taking ``MASTER_PORT``
      is safe because the wrapper hands the training code's ``env://`` a fresh
      port every iteration (and it avoids guessing a second free port).

    ``host_name`` and a ``timedelta`` timeout are accepted as NVIDIA's
    ``inprocess`` store takes them, so its ``store_kwargs`` carry over.
    """
    addr = host or host_name or os.environ.get(envvars.MASTER_ADDR, "127.0.0.1")
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    env_port = os.environ.get("STALWART_INPROCESS_PORT")
    agent = (
        port is None
        and not env_port
        and os.environ.get(envvars.USE_AGENT_STORE) == "True"
        and not os.environ.get(ITERATION_ENV)
    )
    if port is None:
        port = int(env_port) if env_port else int(os.environ.get(envvars.MASTER_PORT, "29500"))
    hosting = is_host and not agent
    if hosting and (addr, port) in _HOSTED:
        return _HOSTED[(addr, port)]
    store = TCPStore(
        addr,
        port,
        is_master=hosting,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
        use_libuv=True,
    )
    if hosting:
        # Kept for the life of the process: a later wrapped call reuses it, so a
        # peer that connects early never meets a server about to go away.
        _HOSTED[(addr, port)] = store
    if agent:
        attempt = os.environ.get(envvars.RESTART_COUNT, "0")
        return PrefixStore(f"stalwart-inprocess/attempt{attempt}/", store)
    return store


def store_port(store: Store) -> int | None:
    """The TCP port of a TCPStore, to keep its connections out of an abort."""
    inner: Any = store
    while isinstance(inner, PrefixStore):
        inner = inner.underlying_store
    port = getattr(inner, "port", None)
    return int(port) if port is not None else None


class CoordStore:
    """The wrapper's view of the store for one rank (one client per thread)."""

    def __init__(
        self,
        store: Store,
        initial_rank: int,
        liveness: CounterWatch[int],
        call: int = 0,
        seal: Seal | None = None,
    ) -> None:
        # One namespace per wrapped call: a process may run several jobs in turn,
        # and a peer can reach the store before this rank has left the last one.
        self.namespace = f"{PREFIX}c{call}/"
        self.store = PrefixStore(self.namespace, store)
        self.raw = store
        self.me = initial_rank
        self.liveness = liveness
        self._warned: set[str] = set()
        self._connection_lost: str | None = None
        # Under stalwart run, records carry the launcher's key (base.sealed): a stranger
        # who reaches the store cannot forge a fault, a port, a rank's exit.
        self._seal = seal if seal is not None else Seal(None, WORKER_LABEL)

    # -- sealed values (counters are not: `add` cannot carry a MAC) ---------------------
    def _put(self, key: str, value: str) -> None:
        self.store.set(key, self._seal.close(self.namespace + key, value.encode()).decode())

    def _first(self, key: str, value: str) -> None:
        """Writes *value* unless *key* holds one already (the first writer wins)."""
        self.store.compare_set(
            key, "", self._seal.close(self.namespace + key, value.encode()).decode()
        )

    def _get(self, key: str) -> bytes | None:
        """The value at *key*, or None when absent or not the job's (logged once)."""
        if not self.store.check([key]):
            return None
        try:
            return self._seal.open(self.namespace + key, self.store.get(key))
        except SealError as err:
            self._refused(key, err)
            return None

    def _refused(self, key: str, why: object) -> None:
        if key not in self._warned and len(self._warned) < 256:
            self._warned.add(key)
            log.warning(
                "rank %d: refused the record at %s%s: %s", self.me, self.namespace, key, why
            )

    # -- heartbeats and liveness -------------------------------------------------
    def heartbeat(self) -> None:
        if self._connection_lost is not None:
            raise RuntimeError(self._connection_lost)
        try:
            self.store.add(f"hb/{self.me}", 1)
        except DistNetworkError as err:
            # torch's TCPStore client never reconnects, and each failed call resolves
            # the socket's addresses through reverse DNS: beating on only loads the
            # resolver, and a beat stuck in its timeout as the process exits aborts it.
            lines = str(err).strip().splitlines()
            self._connection_lost = f"the store connection was lost: {lines[0] if lines else err!r}"
            raise

    def heartbeat_value(self, rank: int) -> int:
        return int(self.store.add(f"hb/{rank}", 0))

    def is_gone(self, rank: int) -> bool:
        """Terminated on record, or its heartbeat stopped."""
        if self.is_terminated(rank):
            return True
        return self.liveness.stale(rank, self.heartbeat_value(rank))

    # -- terminated ranks ----------------------------------------------------------
    def record_terminated(self, rank: int, reason: str) -> None:
        self._first(f"term/{rank}", reason[:2000])

    def is_terminated(self, rank: int) -> bool:
        return self._get(f"term/{rank}") is not None

    def terminated_ranks(self, ranks: Iterable[int]) -> frozenset[int]:
        return frozenset(r for r in ranks if self.is_terminated(r))

    # -- interruptions -------------------------------------------------------------
    def record_interruption(self, record: InterruptionRecord) -> None:
        """Store the record and raise the iteration's fault flag (first record wins)."""
        it = record.iteration
        self._put(f"it{it}/int/{record.rank}", record.to_json().decode())
        self._first(f"it{it}/fault", record.to_json().decode())

    def fault(self, iteration: int) -> InterruptionRecord | None:
        key = f"it{iteration}/fault"
        raw = self._get(key)
        if raw is None:
            return None
        try:
            return parse_interruption(raw, iteration)
        except ValueError as err:
            self._refused(key, err)
            return None

    def interruptions(self, iteration: int, ranks: Iterable[int]) -> list[InterruptionRecord]:
        out = []
        for r in ranks:
            key = f"it{iteration}/int/{r}"
            if (raw := self._get(key)) is not None:
                try:
                    out.append(parse_interruption(raw, iteration))
                except ValueError as err:
                    self._refused(key, err)
        return out

    # -- completion and leaving ------------------------------------------------------
    def record_completed(self, iteration: int) -> None:
        self._put(f"it{iteration}/completed/{self.me}", "1")
        self._first(f"it{iteration}/anycompleted", str(self.me))

    def any_completed(self, iteration: int) -> bool:
        return self._get(f"it{iteration}/anycompleted") is not None

    def record_left(self) -> None:
        self._put(f"left/{self.me}", "1")

    def has_left(self, rank: int) -> bool:
        return self._get(f"left/{rank}") is not None

    # -- rank numbers the assignment gave, for NVIDIA's renumbering -------------------
    def publish_placed_rank(self, iteration: int, rank: int) -> None:
        self._put(f"it{iteration}/placed/{self.me}", str(rank))

    def placed_ranks(self, iteration: int, ranks: Iterable[int], world_size: int) -> dict[int, int]:
        """The rank each of ``ranks`` (initial ranks) was given in ``iteration``; a rank
        with no record, or one that is not a rank below ``world_size``, is left out."""
        out: dict[int, int] = {}
        for r in ranks:
            raw = self._get(f"it{iteration}/placed/{r}")
            if raw is None:
                continue
            # Anyone who reaches the store can write here: a bounded decimal or nothing.
            if len(raw) > 10 or not raw.isdigit():
                continue
            number = int(raw)
            if number < world_size:
                out[r] = number
        return out

    # -- per-iteration port for env:// users -------------------------------------------
    def publish_port(self, iteration: int, port: int) -> None:
        self._put(f"it{iteration}/port", str(port))

    def port(self, iteration: int) -> int | None:
        key = f"it{iteration}/port"
        raw = self._get(key)
        if raw is None:
            return None
        port = parse_port(raw)
        if port is None:
            self._refused(key, "expected a port 1..65535")
        return port

    def user_store(self, iteration: int) -> Store:
        """A store for the wrapped function's own ``init_process_group(store=...)``."""
        return PrefixStore(f"{self.namespace}it{iteration}/user/", self.raw)

    # -- barriers -----------------------------------------------------------------------
    def barrier(
        self,
        name: str,
        participants: list[int],
        timeout: float | None,
        *,
        clock_starts: Callable[[], bool] | None = None,
        analyse_every: float = 0.1,
    ) -> frozenset[int]:
        """Wait until every participant arrived or is gone; returns the gone ones.

        The rank that completes the barrier writes the terminated set into the
        ``done`` key with compare-and-set, so all ranks read one answer even if
        their views of heartbeats differ.  ``clock_starts`` delays the timeout
        (spares wait in the completion barrier for as long as training lasts).
        """
        base = f"b/{name}"
        done = f"{base}/done"
        self._put(f"{base}/a/{self.me}", "1")
        # The counter only says when to look: anyone can add to it, so the arrivals
        # themselves (sealed) decide.
        if int(self.store.add(f"{base}/n", 1)) >= len(participants) and all(
            self._arrived(base, r) for r in participants
        ):
            self._finish(base, participants)
        start: float | None = time.monotonic() if clock_starts is None else None
        poll = _POLL_MIN
        next_analysis = time.monotonic() + analyse_every
        while True:
            if self.store.check([done]):
                raw = self._get(done)
                try:
                    if raw is not None:
                        return parse_gone(raw, participants)
                except ValueError as err:
                    self._refused(done, err)
                # A stranger's value took the key first and cannot be replaced: each
                # rank judges alone once everyone arrived or is gone.
                if all(self._arrived(base, r) or self.is_gone(r) for r in participants):
                    return self.terminated_ranks(participants)
            now = time.monotonic()
            if start is None and clock_starts is not None and clock_starts():
                start = now
            if now >= next_analysis:
                next_analysis = now + analyse_every
                missing = [r for r in participants if not self._arrived(base, r)]
                if all(self.is_gone(r) for r in missing):
                    for r in missing:
                        self.record_terminated(r, "missing at barrier " + name)
                    self._finish(base, participants)
                    continue
            if timeout is not None and start is not None and now - start > timeout:
                raise BarrierTimeout(f"barrier {name!r} timed out after {timeout:.1f}s")
            time.sleep(poll)
            poll = min(poll * 2, _POLL_MAX)

    def _arrived(self, base: str, rank: int) -> bool:
        return self._get(f"{base}/a/{rank}") is not None

    def _finish(self, base: str, participants: list[int]) -> None:
        gone = sorted(self.terminated_ranks(participants))
        self._first(f"{base}/done", json.dumps(gone))
