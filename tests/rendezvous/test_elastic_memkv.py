"""The elastic rendezvous end to end on an in-memory store: nodes are threads of this
process, so join, close, spares, lost nodes and last call need no server, no root and
no network namespace (the same code runs on c10d and etcd in tests/multinode)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest

# Node 0 of a round hosts the workers' (real) TCPStore: torch loads at collection, not
# within the first join's timeout.
import torch.distributed  # noqa: F401

from stalwart.base.events import Event
from stalwart.health.admission import HealthGate, HealthSettings
from stalwart.health.records import health_key
from stalwart.rendezvous import keys
from stalwart.rendezvous.api import (
    JobEnded,
    NodeLost,
    RendezvousError,
    RendezvousInfo,
    StoreLost,
    WorkerFailed,
)
from stalwart.rendezvous.close_rule import ElasticSettings
from stalwart.rendezvous.elastic import ElasticRendezvous
from stalwart.rendezvous.kv import MemoryKV, MemoryStore
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(30)

# A node is lost after 0.6 s without a beat: long enough for a loaded machine.
BASE = ElasticSettings(
    min_nodes=1,
    max_nodes=1,
    max_restarts=3,
    join_timeout=10.0,
    last_call_timeout=30.0,
    close_timeout=0.5,
    keep_alive_interval=0.1,
    keep_alive_max_attempt=6,
)


def settings(lo: int, hi: int, **kw: float) -> ElasticSettings:
    return replace(BASE, min_nodes=lo, max_nodes=hi, **kw)


class Cluster:
    def __init__(self, s: ElasticSettings, *, leases: bool = False) -> None:
        self.store = MemoryStore(leases=leases)
        self.settings = s
        self.nodes: list[ElasticRendezvous] = []
        self.kvs: list[MemoryKV] = []
        self.pool = ThreadPoolExecutor(8)

    def node(self) -> ElasticRendezvous:
        kv = MemoryKV(self.store, f"memory#{len(self.nodes)}")
        rdzv = ElasticRendezvous(kv, self.settings, run_id="mem", local_addr="127.0.0.1")
        self.nodes.append(rdzv)
        self.kvs.append(kv)
        return rdzv

    def join(
        self, rdzv: ElasticRendezvous, round_: int = 0, nproc: int = 1
    ) -> Future[RendezvousInfo]:
        return self.pool.submit(rdzv.join, round_, nproc)

    def kill(self, rdzv: ElasticRendezvous) -> None:
        """The node dies without a word: it stops beating and reaches nothing."""
        self.kvs[self.nodes.index(rdzv)].cut()


@contextmanager
def cluster(s: ElasticSettings, *, leases: bool = False) -> Iterator[Cluster]:
    c = Cluster(s, leases=leases)
    try:
        yield c
    finally:
        for rdzv in c.nodes:
            rdzv.finish(False, "test over")  # spares still waiting stop
        for rdzv in c.nodes:
            rdzv.leave()
        c.pool.shutdown(wait=True, cancel_futures=True)


def test_max_nodes_close_the_round_at_once_with_one_workers_store() -> None:
    with cluster(settings(2, 2)) as c:
        a, b = c.node(), c.node()
        fa, fb = c.join(a, nproc=2), c.join(b, nproc=1)
        ia, ib = fa.result(5), fb.result(5)
    assert sorted([ia.group_rank, ib.group_rank]) == [0, 1]
    assert ia.world_size == ib.world_size == 3 and ia.group_world_size == 2
    assert (ia.master_addr, ia.master_port) == (ib.master_addr, ib.master_port)
    first, second = sorted([ia, ib], key=lambda i: i.group_rank)
    assert first.base_rank == 0 and second.base_rank == (2 if first is ia else 1)
    assert ia.duration < 5  # closed on MAX, not on last call (30 s)


def test_min_nodes_close_after_last_call() -> None:
    with cluster(settings(1, 3, last_call_timeout=0.2)) as c:
        info = c.join(c.node()).result(5)
    assert info.group_world_size == 1 and info.round == 0
    assert info.duration >= 0.2


def test_too_few_nodes_within_the_join_timeout_is_a_one_line_error() -> None:
    with cluster(settings(2, 2, join_timeout=0.3)) as c:
        fut = c.join(c.node())
        with pytest.raises(RendezvousError, match=r"only 1 of at least 2 node\(s\) joined round 0"):
            fut.result(5)


def test_a_stranger_raising_the_joined_counter_costs_bounded_reads_and_one_line() -> None:
    # The counter is a plain store number (``add`` cannot be sealed).  Raised to 10**9,
    # it once made each node build and read 10**9 slot keys per poll.
    with cluster(settings(1, 1, join_timeout=0.5)) as c:
        stranger = MemoryKV(c.store, "stranger")
        stranger.add(keys.Round(0).joined, 10**9)
        fut = c.join(c.node())
        with pytest.raises(RendezvousError, match=r"joined round 0"):
            fut.result(20)


def test_a_spare_takes_the_place_of_a_lost_node_at_the_next_round() -> None:
    with cluster(settings(2, 2)) as c:
        a, b, spare = c.node(), c.node(), c.node()
        fa, fb = c.join(a), c.join(b)
        ia, ib = fa.result(5), fb.result(5)
        waiting = c.join(spare)  # the round runs: it waits for the next one
        wait_for(lambda: c.store.data.get(keys.Round(1).joined) == b"1", 5, "a spare")
        assert not waiting.done()
        lost = b if ib.group_rank == 1 else a
        survivor = a if lost is b else b
        c.kill(lost)
        # The survivor learns of the loss from the keep-alives and fails the round.
        wait_for(lambda: survivor.failed(0), 5, "the loss of a silent node")
        recs = survivor.failures(0)
        assert [type(r) for r in recs] == [NodeLost]
        assert recs[0].node_rank == (ib if lost is b else ia).group_rank
        again = c.join(survivor, round_=1).result(5)
        admitted = waiting.result(5)
    assert again.round == admitted.round == 1
    # The survivor keeps its rank 0; the spare follows; the lost node is named.
    assert (again.group_rank, admitted.group_rank) == (0, 1)
    assert len(again.left) == 1 and "node rank 1" in again.left[0]


def test_a_round_closes_without_last_call_once_every_live_member_is_back() -> None:
    """A node that left (excluded) is not waited for: the others are all back."""
    with cluster(settings(2, 3)) as c:  # last call 30 s: only "all back" can close it
        nodes = [c.node() for _ in range(3)]
        futs = [c.join(n) for n in nodes]
        infos = [f.result(5) for f in futs]
        gone = nodes[2]
        gone.leave()
        nodes[0].report_failure(
            0, WorkerFailed(node_rank=infos[0].group_rank, local_rank=0, pid=1, exitcode=1)
        )
        t0 = time.monotonic()
        f0, f1 = c.join(nodes[0], round_=1), c.join(nodes[1], round_=1)
        i0, i1 = f0.result(5), f1.result(5)
    assert time.monotonic() - t0 < 5
    assert i0.group_world_size == i1.group_world_size == 2
    # Survivors keep their order.
    assert (i0.group_rank < i1.group_rank) == (infos[0].group_rank < infos[1].group_rank)


def test_a_spare_stops_when_the_job_ends_without_it() -> None:
    with cluster(settings(1, 1)) as c:
        a, spare = c.node(), c.node()
        c.join(a).result(5)
        waiting = c.join(spare)
        a.finish(True, "succeeded in attempt 0")
        with pytest.raises(JobEnded, match="succeeded in attempt 0") as ended:
            waiting.result(5)
    assert ended.value.succeeded


def test_a_leased_heartbeat_that_vanishes_is_a_loss_at_once() -> None:
    """etcd: a dead node's lease expires and its key goes; no waiting for silence."""
    slow = settings(2, 2, keep_alive_interval=1.0, keep_alive_max_attempt=30)
    with cluster(slow, leases=True) as c:
        a, b = c.node(), c.node()
        fa, fb = c.join(a), c.join(b)
        fa.result(5), fb.result(5)
        c.kill(b)
        t0 = time.monotonic()
        wait_for(lambda: a.failed(0), 5, "the loss of a node whose key vanished")
    assert time.monotonic() - t0 < 3  # not the 30 s of silence


def test_a_node_cut_off_from_the_store_stops_with_store_lost() -> None:
    with cluster(settings(2, 2)) as c:
        a = c.node()
        c.kill(a)
        with pytest.raises(StoreLost):
            c.join(a).result(5)


class _LateAnswer(MemoryKV):
    """A store client whose answer to one read of a round's close arrives late: read
    before the round closed, delivered after the round closed and the job ended (a
    resent segment on a lossy link)."""

    def __init__(self, store: MemoryStore, name: str, hold: threading.Event) -> None:
        super().__init__(store, name)
        self.hold = hold
        self.closed_reads = 0

    def get(self, key: str) -> bytes | None:
        if key == keys.Round(0).closed:
            self.closed_reads += 1
            if self.closed_reads == 2:  # the first is the join's look for an open round
                value = super().get(key)
                self.hold.wait(10)
                return value
        return super().get(key)


def test_a_node_kept_out_says_why_when_the_job_ends_while_it_waits() -> None:
    key = health_key(b"s" * 32, "mem")
    s = settings(1, 2, last_call_timeout=0.5)
    store = MemoryStore()
    hold = threading.Event()
    seen: dict[str, list[dict[str, Any]]] = {"good": [], "bad": []}

    def gate(who: str, **kw: Any) -> HealthGate:
        def emit(ev: Event, **f: Any) -> None:
            if ev is Event.NODE_EXCLUDED:
                seen[who].append(f)

        return HealthGate(HealthSettings(measure=False, **kw), key, "mem", emit)

    gates = [gate("good"), gate("bad", command="exit 4")]
    good = ElasticRendezvous(
        MemoryKV(store, "good"), s, run_id="mem", local_addr="127.0.0.1", gate=gates[0]
    )
    late = _LateAnswer(store, "bad", hold)
    bad = ElasticRendezvous(late, s, run_id="mem", local_addr="127.0.0.1", gate=gates[1])
    pool = ThreadPoolExecutor(2)
    try:
        waiting = pool.submit(bad.join, 0, 1)
        # Its report is in and its look at the round's close is on the way.
        wait_for(lambda: late.closed_reads >= 2, timeout=10, what="the bad node's wait")
        info = good.join(0, 1)
        assert info.group_world_size == 1
        good.finish(True, "succeeded in attempt 0")
        hold.set()
        with pytest.raises(JobEnded):
            waiting.result(10)
    finally:
        hold.set()
        for rdzv in (good, bad):
            rdzv.finish(False, "test over")
            rdzv.leave()
        for g in gates:
            g.close()
        pool.shutdown(wait=True, cancel_futures=True)
    for who in ("good", "bad"):
        assert len(seen[who]) == 1, (who, seen)  # every node, the one kept out included
        f = seen[who][0]
        assert f["node"] == bad.id and f["this_node"] is (who == "bad"), (who, f)
        assert "exit" in f["reason"], f
