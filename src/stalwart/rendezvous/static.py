"""Static membership: a fixed count of nodes meeting through one c10d ``TCPStore``.

One launcher hosts the job's store (the only one for a single node, node rank 0 for a
static multi-node job); the others connect to it.  Keys are namespaced per round
(``r<n>/...``).  For every round the host also starts a *fresh* ``TCPStore`` for the
workers' own ``init_process_group``: torchrun 2.13 shares one store across attempts and
its restarted workers then read a dead peer's address, failing most restarts here.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from stalwart.base.sealed import Seal
from stalwart.rendezvous import keys
from stalwart.rendezvous.api import (
    FailureRecord,
    JobEnded,
    RendezvousError,
    RendezvousInfo,
    bounded_failure,
)
from stalwart.rendezvous.kv import (
    STORE_LABEL,
    C10dKV,
    SealedKV,
    check_run_id,
    host_store,
    parse_address,
    parse_count,
    read_failures,
)
from stalwart.rendezvous.members import JobEnd, decode_or_none

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

logger = logging.getLogger(__name__)

_POLL = 0.005  # store round trips are ~0.1 ms; keep joins snappy without spinning
# Bounds one store call (torch's read_timeout): static jobs have no keep-alive, so a cut
# link shows up here.
OP_TIMEOUT = 30.0


@dataclass(frozen=True)
class StoreEndpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def _is_loopback_name(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class StaticRendezvous:
    """Static-membership rendezvous of *nnodes* launchers through one ``TCPStore``."""

    elastic = False

    def __init__(
        self,
        *,
        run_id: str,
        nnodes: int,
        endpoint: StoreEndpoint,
        host_store: bool,
        node_rank: int | None,
        master_addr: str,
        join_timeout: float = 600.0,
        exit_barrier_timeout: float = 30.0,
        op_timeout: float = OP_TIMEOUT,
        seal: Seal | None = None,
    ) -> None:
        self.run_id = run_id
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.join_timeout = join_timeout
        self.exit_barrier_timeout = exit_barrier_timeout
        self.is_host = host_store
        self._master_addr = master_addr
        self._worker_stores: dict[int, TCPStore] = {}
        self._warned: set[str] = set()
        store = C10dKV(
            endpoint.host,
            endpoint.port,
            is_host=host_store,
            connect_timeout=join_timeout,
            op_timeout=op_timeout,
        )
        self.endpoint = StoreEndpoint(endpoint.host, store.port)
        # Job end, failures, addresses, worker counts: what steers the job is sealed.
        self.kv = SealedKV(store, seal if seal is not None else Seal(None, STORE_LABEL))
        check_run_id(self.kv, run_id, host_store, join_timeout, str(self.endpoint))

    # -- helpers -----------------------------------------------------------------------
    def _wait(self, names: list[str], what: str, deadline: float) -> None:
        while any(v is None for v in self.kv.get_many(names)):
            # A node that ended the job (a crash loop it stopped) will not join again.
            raw = self.kv.get(keys.JOB_ENDED)
            ended = (
                None if raw is None else decode_or_none(raw, JobEnd, keys.JOB_ENDED, self._warned)
            )
            if ended is not None:
                raise JobEnded(ended.succeeded, ended.reason, ended.exit_code)
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"rendezvous {self.run_id}: timed out after {self.join_timeout:g}s "
                    f"waiting for {what}"
                )
            time.sleep(_POLL)

    def _local_address(self) -> str:
        return self._master_addr or socket.getfqdn()

    # -- the protocol ------------------------------------------------------------------
    def join(self, round_: int, local_world_size: int) -> RendezvousInfo:
        t0 = time.monotonic()
        deadline = t0 + self.join_timeout
        if self.node_rank is None:
            # Automatic node ranks: in order of first arrival, kept for the whole job.
            self.node_rank = self.kv.add(keys.NODE_COUNTER, 1) - 1
            if self.node_rank >= self.nnodes:
                raise RendezvousError(
                    f"rendezvous {self.run_id}: already {self.nnodes} nodes; this one is extra"
                )
        k = keys.Round(round_)
        self.kv.set(k.nproc(self.node_rank), str(local_world_size))
        self._wait(
            [k.nproc(i) for i in range(self.nnodes)],
            f"{self.nnodes} node(s) to join round {round_}",
            deadline,
        )
        raw = self.kv.get_many([k.nproc(i) for i in range(self.nnodes)])
        sizes = [parse_count(v, k.nproc(i)) for i, v in enumerate(raw)]
        if self.node_rank == 0:
            self._open_worker_store(round_)
        self._wait([k.master], "node 0 to publish the worker store", deadline)
        addr, port = parse_address(self.kv.get(k.master), k.master)
        return RendezvousInfo(
            round=round_,
            group_rank=self.node_rank,
            group_world_size=self.nnodes,
            base_rank=sum(sizes[: self.node_rank]),
            world_size=sum(sizes),
            master_addr=addr,
            master_port=port,
            duration=time.monotonic() - t0,
        )

    def _open_worker_store(self, round_: int) -> None:
        # Old rounds' stores are closed so a straggler of a dead attempt cannot reach its
        # peers' successors through them.
        for r in list(self._worker_stores):
            del self._worker_stores[r]
        addr = self._local_address()
        if self.nnodes == 1 and not _is_loopback_name(addr):
            # One node: the workers are all here, so their store is reachable from
            # loopback only, whatever --master-addr names.
            addr = "127.0.0.1"
        store = host_store(addr, 0, self.join_timeout)
        self._worker_stores[round_] = store
        self.kv.set(keys.Round(round_).master, f"{addr}:{store.port}")

    def report_failure(self, round_: int, failure: FailureRecord) -> None:
        k = keys.Round(round_)
        self.kv.set(k.failure(failure.node_rank), bounded_failure(failure).encode().decode())
        self.kv.create(k.failed, str(failure.node_rank))

    def failed(self, round_: int) -> bool:
        # The flag alone is not enough: a node writes its record before the flag, so a
        # flag without a valid record is a stranger's (or garbage) and fails nothing.
        return self.kv.get(keys.Round(round_).failed) is not None and bool(self.failures(round_))

    def failures(self, round_: int) -> list[FailureRecord]:
        return read_failures(self.kv, round_, self.nnodes, self._warned)

    def waiting(self, round_: int) -> int:
        return 0  # fixed membership: the job never grows

    @property
    def name(self) -> str:
        # Fixed membership: a node keeps its rank for the whole job.
        return f"node rank {self.node_rank}"

    def node_names(self, round_: int) -> tuple[str, ...]:
        return tuple(f"node rank {i}" for i in range(self.nnodes))

    def withdraw(self) -> int:
        """No other node can take this one's place in a fixed membership."""
        return 0

    # Done and left are a sealed key per node, not counters: a counter carries no MAC,
    # and a stranger who writes a non-number to one makes the store drop the next
    # client that adds to it (the job then reads as having lost its store).
    def report_done(self, round_: int) -> None:
        self.kv.set(keys.Round(round_).done(self._rank()), "1")

    def all_done(self, round_: int) -> bool:
        names = [keys.Round(round_).done(i) for i in range(self.nnodes)]
        return all(v is not None for v in self.kv.get_many(names))

    def _rank(self) -> int:
        if self.node_rank is None:
            raise RuntimeError("used before join()")
        return self.node_rank

    def finish(self, succeeded: bool, reason: str, exit_code: int | None = None) -> None:
        """Static membership has no spares, but a peer that decided to restart may be
        waiting for this node in the next round: it reads why the job ended instead."""
        try:
            end = JobEnd(succeeded, reason, exit_code)
            self.kv.create(keys.JOB_ENDED, msgspec.json.encode(end).decode())
        except RendezvousError as err:
            logger.debug("finish(): %s", err)

    def interrupt(self) -> None:
        """Nothing waits unbounded in ``leave`` here (the exit barrier has a timeout)."""

    def leave(self) -> None:
        """Exit barrier: the host keeps the store up until every node has left."""
        try:
            if self.node_rank is not None:
                self.kv.set(keys.left(str(self.node_rank)), "1")
            if self.is_host and self.nnodes > 1:
                deadline = time.monotonic() + self.exit_barrier_timeout
                names = [keys.left(str(i)) for i in range(self.nnodes)]
                while not all(v is not None for v in self.kv.get_many(names)):
                    if time.monotonic() > deadline:
                        logger.warning("not every node left within %ss", self.exit_barrier_timeout)
                        break
                    time.sleep(0.05)
        except RendezvousError as err:  # the host may already be gone; nothing left to do
            logger.debug("leave(): %s", err)
        self._worker_stores.clear()
