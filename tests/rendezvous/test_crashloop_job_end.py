"""A node that stops a crash loop tells the others through the job's end record, with
its exit code, so every node exits the same way; a record a stranger forged out of
bounds is dropped."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

# The host of a round opens the workers' (real) TCPStore: torch loads at collection.
import torch.distributed  # noqa: F401

from stalwart.rendezvous import keys
from stalwart.rendezvous.api import JobEnded
from stalwart.rendezvous.close_rule import ElasticSettings
from stalwart.rendezvous.elastic import ElasticRendezvous
from stalwart.rendezvous.kv import MemoryKV, MemoryStore
from stalwart.rendezvous.static import StaticRendezvous, StoreEndpoint
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(60)

HOSTILE = [
    '{"succeeded":false,"reason":"x","exit_code":0}',  # would read as success
    '{"succeeded":false,"reason":"x","exit_code":137}',  # would read as a signal
    '{"succeeded":false,"reason":"x","exit_code":-1}',
    '{"succeeded":false,"reason":"x","exit_code":100000000000000000000000}',
    '{"succeeded":false,"reason":"x","exit_code":"93"}',
    '{"succeeded":"no","exit_code":93}',
    "[" * 100_000,
    "\xff" * 1000,
]


@contextmanager
def static_pair(join_timeout: float) -> Iterator[tuple[StaticRendezvous, StaticRendezvous]]:
    port = free_port()
    ep = StoreEndpoint("127.0.0.1", port)
    common = dict(run_id="loop", nnodes=2, master_addr="127.0.0.1", join_timeout=join_timeout)
    host = StaticRendezvous(endpoint=ep, host_store=True, node_rank=0, **common)  # type: ignore[arg-type]
    peer = StaticRendezvous(endpoint=ep, host_store=False, node_rank=1, **common)  # type: ignore[arg-type]
    yield host, peer


def test_static_peer_waiting_for_the_next_round_exits_with_the_verdicts_code() -> None:
    with static_pair(join_timeout=8.0) as (host, peer), ThreadPoolExecutor(2) as pool:
        first = [pool.submit(n.join, 0, 1) for n in (host, peer)]
        for f in first:
            f.result(timeout=30)
        # The peer decided to restart; the host stopped the crash loop.
        waiting = pool.submit(peer.join, 1, 1)
        host.finish(False, "crash loop: rank 1 ...", 93)
        with pytest.raises(JobEnded) as ended:
            waiting.result(timeout=20)
        assert ended.value.exit_code == 93 and not ended.value.succeeded
        assert ended.value.reason == "crash loop: rank 1 ..."


@pytest.mark.parametrize("raw", HOSTILE)
def test_static_drops_a_forged_job_end_out_of_bounds(raw: str) -> None:
    with static_pair(join_timeout=30.0) as (host, peer), ThreadPoolExecutor(2) as pool:
        host.kv.set(keys.JOB_ENDED, raw)
        joins = [pool.submit(n.join, 0, 1) for n in (host, peer)]
        infos = [f.result(timeout=30) for f in joins]
        assert [i.group_rank for i in infos] == [0, 1]


S = ElasticSettings(
    min_nodes=2,
    max_nodes=2,
    max_restarts=5,
    join_timeout=10.0,
    last_call_timeout=30.0,
    close_timeout=0.5,
    keep_alive_interval=0.1,
    keep_alive_max_attempt=6,
)


def _elastic_pair() -> tuple[ElasticRendezvous, ElasticRendezvous]:
    store = MemoryStore()
    return (
        ElasticRendezvous(MemoryKV(store, "m#0"), S, run_id="mem", local_addr="127.0.0.1"),
        ElasticRendezvous(MemoryKV(store, "m#1"), S, run_id="mem", local_addr="127.0.0.1"),
    )


def test_elastic_peer_joining_the_next_round_exits_with_the_verdicts_code() -> None:
    a, b = _elastic_pair()
    try:
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(n.join, 0, 1) for n in (a, b)]:
                f.result(timeout=20)
            a.finish(False, "crash loop", 93)
            with pytest.raises(JobEnded) as ended:
                b.join(1, 1)
        assert ended.value.exit_code == 93
    finally:
        for n in (a, b):
            n.leave()


@pytest.mark.parametrize("raw", HOSTILE)
def test_elastic_drops_a_forged_job_end_out_of_bounds(raw: str) -> None:
    a, b = _elastic_pair()
    try:
        a.kv.set(keys.JOB_ENDED, raw)
        with ThreadPoolExecutor(2) as pool:
            infos = [f.result(timeout=20) for f in [pool.submit(n.join, 0, 1) for n in (a, b)]]
        assert sorted(i.group_rank for i in infos) == [0, 1]
    finally:
        for n in (a, b):
            n.leave()


def test_elastic_spare_learns_the_job_ended_before_it_checks_again() -> None:
    """A node kept out of a round rejoins the next one at once; when the job ended in
    between, it leaves without running a health check for a round that never comes."""
    from stalwart.base.events import Event
    from stalwart.health.admission import HealthGate, HealthSettings
    from stalwart.health.records import health_key

    events: list[Event] = []
    gate = HealthGate(
        HealthSettings(measure=False, wait=1.0),
        health_key(b"k" * 32, "mem"),
        "mem",
        lambda ev, **f: events.append(ev),
    )
    store = MemoryStore()
    a, b = (
        ElasticRendezvous(MemoryKV(store, f"m#{i}"), S, run_id="mem", local_addr="127.0.0.1")
        for i in range(2)
    )
    nodes = [a, b]
    try:
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(n.join, 0, 1) for n in (a, b)]:
                f.result(timeout=20)
        # It came after round 0 closed full, and its next try is round 1.
        spare = ElasticRendezvous(
            MemoryKV(store, "m#2"), S, run_id="mem", local_addr="127.0.0.1", gate=gate
        )
        nodes.append(spare)
        a.finish(True, "done")
        with pytest.raises(JobEnded) as ended:
            spare.join(1, 1)
        assert ended.value.succeeded
        assert Event.HEALTH_CHECKED not in events, events
    finally:
        gate.close()
        for n in nodes:
            n.leave()
