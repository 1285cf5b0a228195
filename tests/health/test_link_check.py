"""The collective link check against a stranger: forged or oversized results in the job's
store and forged timings in the check's own store are refused, and frame nobody. The
check's processes are real (``python -m stalwart.health.linkrun``, torch, TCPStore)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import msgspec
import pytest
from torch._C._distributed_c10d import TCPStore

from stalwart.health.admission import HealthGate, HealthSettings
from stalwart.health.judge import Limits
from stalwart.health.linkcheck import LinkCheck, check_key
from stalwart.health.linkrun import Forged, Orders, sealed, unseal
from stalwart.health.records import (
    Blame,
    CollectiveLinks,
    NodeReport,
    health_key,
    link_count,
    link_node,
    link_store_key,
    report_key,
    sign,
)
from stalwart.rendezvous import keys
from stalwart.rendezvous.kv import MemoryKV, MemoryStore
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(90)

KEY = health_key(secrets.token_bytes(32), "job")
CHECK = check_key(KEY)
NODES = ("n0", "n1", "n2")


def report(node: str, *blamed: str) -> NodeReport:
    found = CollectiveLinks(members=NODES, nodes=tuple(Blame(b, "slow, they say") for b in blamed))
    return NodeReport(run_id="job", round=0, node=node, host=node, collective=found)


@pytest.mark.parametrize(
    "forge",
    [
        # A result blaming n1, signed with a key that is not the job's.
        lambda n: sign(health_key(b"x" * 32, "job"), report(n, "n1")),
        # Unsigned.
        lambda n: msgspec.json.encode(report(n, "n1")).decode(),
        # Signed, but oversized: a member list of a thousand long names.
        lambda n: sign(
            KEY,
            NodeReport(
                run_id="job",
                round=0,
                node=n,
                host=n,
                collective=CollectiveLinks(
                    members=tuple(f"{i:0128d}" for i in range(1000)),
                    nodes=(Blame("n1", "slow"),),
                ),
            ),
        ),
    ],
)
def test_a_forged_or_oversized_link_result_is_refused(forge: object) -> None:
    kv = MemoryKV(MemoryStore())
    for n in NODES:
        kv.set(report_key(0, n), sign(KEY, report(n)))
    gate = HealthGate(HealthSettings(), KEY, "job")
    assert gate.refused(kv, 0, list(NODES)) == {}
    for n in ("n0", "n2"):  # a majority, had they been genuine
        kv.set(report_key(0, n), forge(n))  # type: ignore[operator]
    assert "n1" not in HealthGate(HealthSettings(), KEY, "job").refused(kv, 0, list(NODES))
    # The same results signed with the job's key would have kept n1 out.
    for n in ("n0", "n2"):
        kv.set(report_key(0, n), sign(KEY, report(n, "n1")))
    refused = HealthGate(HealthSettings(), KEY, "job").refused(kv, 0, list(NODES))
    assert list(refused) == ["n1"] and "slow, they say" in refused["n1"]


def signed_as(where: str, value: str) -> str:
    """*value* signed with the check's key, as a member would (whatever it says)."""
    mac = hmac.new(CHECK, (where + "\0" + value).encode(), hashlib.sha256).hexdigest()
    return f"{value}|{mac}"


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (lambda w: sealed(CHECK, w, 0.0125), 0.0125),
        (lambda w: sealed(CHECK, w, None), None),
        # Signed for another key, or for another key of the store (a replay).
        (lambda w: sealed(check_key(health_key(b"y" * 32, "job")), w, 0.001), "not signed"),
        (lambda w: sealed(CHECK, w + "x", 0.001), "not signed"),
        # Oversized, garbage, a signed value that is no time.
        (lambda w: "7" * 2**20, "a value of 1048576 bytes"),
        (lambda w: "\xff\xfe|" * 3, "not signed"),
        (lambda w: signed_as(w, "nan"), "not a time"),
        (lambda w: signed_as(w, "-1.0"), "not a time"),
        (lambda w: signed_as(w, "soon"), "not a time"),
    ],
)  # fmt: skip
def test_a_timing_is_read_back_only_when_it_is_the_checks_own(
    raw: Callable[[str], str], want: float | str | None
) -> None:
    where = "stalwart-links/r0/s0/g1/t0"
    value = raw(where).encode("utf-8", "surrogateescape")
    if isinstance(want, str):
        with pytest.raises(Forged, match=want):
            unseal(CHECK, where, value)
    else:
        assert unseal(CHECK, where, value) == want


@pytest.mark.parametrize("forged", [True, False])
def test_forged_timings_void_the_check_where_genuine_ones_blame_the_missing_node(
    forged: bool,
) -> None:
    """Members n1 and n2 meet on a store (n0, whose store it would be, said it was
    ready and vanished: every group with it fails at its timeout). Genuine timings: both
    find n0 broken and blame it alone. A stranger who filled the stage's keys first with
    timings that say all is fast, not signed with the job's key: both members refuse
    them and conclude nothing."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=5))  # fmt: skip
    prefix = "stalwart-links/r0"
    store.set(f"{prefix}/ready/0", signed_as(f"{prefix}/ready/0", "1"))
    wrong = check_key(health_key(b"y" * 32, "job"))
    if forged:
        # Stage 0 of three nodes: the whole group, then the pairs (n1, n2) and (n0, n1).
        for g, size in enumerate((3, 2, 2)):
            for i in range(size):
                where = f"{prefix}/s0/g{g}/t{i}"
                store.set(where, sealed(wrong, where, 0.001))
    procs = []
    for rank in (1, 2):  # side by side, as on two nodes
        orders = Orders(
            rank=rank,
            members=NODES,
            host="127.0.0.1",
            store=f"127.0.0.1:{store.port}",
            prefix=prefix,
            key=check_key(KEY).hex(),
            stage_timeout=1.0,
        )
        p = subprocess.Popen(
            [sys.executable, "-m", "stalwart.health.linkrun"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert p.stdin is not None
        p.stdin.write(msgspec.json.encode(orders) + b"\n")
        p.stdin.flush()
        procs.append(p)
    for p in procs:
        assert p.stdin is not None and p.stdout is not None and p.stderr is not None
        p.stdin.close()
        p.wait(timeout=80)
        out, err = p.stdout.read(), p.stderr.read()
        assert p.returncode == 0, err.decode()[-2000:]
        found = msgspec.json.decode(out.splitlines()[-1], type=CollectiveLinks)
        assert found.links == (), found
        if forged:
            assert found.nodes == (), found
            assert "forged timing" in found.void and "not signed" in found.void
        else:
            assert found.void == "" and [b.node for b in found.nodes] == ["n0"], found
            assert found.backend == "gloo" and found.stages == 2, found


def test_a_check_waiting_for_a_peer_gives_up_when_the_job_ends() -> None:
    """A spare checks for the next round while the job runs; its peer in the check never
    comes. Once the job's end record is in the store it stops waiting (its bound is
    40 s here), so it leaves with the job and the store's host does not wait for it."""
    kv = MemoryKV(MemoryStore())
    ended: list[float] = []
    check = LinkCheck(KEY, "job", expected=2, limits=Limits(), bound=40.0)
    check.start()

    def peer_then_end() -> None:
        # The peer counts itself in after this node (so this node serves the check's
        # store), never shows up; then the job ends.
        wait_for(lambda: kv.add(link_count(0), 0) == 1 or None, timeout=30)
        kv.add(link_count(0), 1)
        kv.set(link_node(0, 1), "ghost")
        wait_for(lambda: kv.get(link_store_key(0)), timeout=60)
        ended.append(time.monotonic())
        kv.set(keys.JOB_ENDED, '{"succeeded": true, "reason": "done"}')

    helper = threading.Thread(target=peer_then_end, daemon=True)
    helper.start()
    found = check.run(kv, 0, "n0", "127.0.0.1", lambda ids: ids)
    returned = time.monotonic()
    helper.join(timeout=5)
    # Its process alone would give up on the peer after its own 10 s.
    assert ended and returned - ended[0] < 3.0, (ended, returned)
    assert found is not None and found.members == ("n0", "ghost") and found.void, found
