"""A replica that lags its node, then a node loss: the job still resumes from RAM.

A survivor's own segment keeps its two newest snapshots; the replica it holds of a lost
peer may be older than both (a slow stream, a busy host). The survivor pins its own
ranks' snapshot at the replica's step, so the resume agreement finds a step every rank
has in RAM; and a node that holds an old replica of a rank it takes over fetches a newer
one a peer has. The agreement runs as in a job: one process per rank, ``restore``
through a real ``TCPStore``, with the launcher's folders of the nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig
from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint.ram import find_snapshots
from stalwart.launch.replicas import node as rp
from stalwart.launch.replicas.pins import PinPlan, pin_is_stale, plan_pin
from stalwart.launch.replicas.ring import fetch_order
from stalwart.launch.replicas.snapshots import SnapshotMemory
from stalwart.rendezvous.kv import C10dKV
from tests.helpers import ROOT

from .replica_helpers import (
    KEY,
    Events,
    addr,
    fetch_missing,
    publish_owner,
    push,
    replica_steps,
    server,
    snapshot,
    state,
)

pytestmark = pytest.mark.timeout(120)

WORLD = 2


@pytest.mark.parametrize(
    ("pinned", "local", "replica", "want"),
    [
        (None, [(0, 4), (1, 2)], 4, PinPlan(copy_slot=0)),
        (None, [(1, 6), (0, 4)], 4, PinPlan(copy_slot=0)),  # the older local slot
        (4, [(0, 8), (1, 6)], 4, PinPlan()),  # pinned already: nothing to copy
        (2, [(0, 6), (1, 4)], 4, PinPlan(copy_slot=1)),  # forward
        (2, [(0, 8), (1, 6)], 4, PinPlan()),  # the local step is gone: keep the old pin
        (8, [(0, 4), (1, 2)], 4, PinPlan(copy_slot=0)),  # went back: re-pin at the replica
        (8, [(0, 3), (1, 2)], 4, PinPlan(drop=True)),  # went back, nothing to pin
        (None, [], 4, PinPlan()),
    ],
)
def test_plan_pin(
    pinned: int | None, local: list[tuple[int, int]], replica: int, want: PinPlan
) -> None:
    assert plan_pin(pinned, local, replica) == want


@pytest.mark.parametrize(
    ("pinned", "newest", "want"),
    [(None, 8, False), (4, 8, False), (4, 4, False), (8, 4, True), (4, None, False)],
)
def test_pin_is_stale(pinned: int | None, newest: int | None, want: bool) -> None:
    assert pin_is_stale(pinned, newest) is want


@pytest.mark.parametrize(
    ("have", "offers", "want"),
    [
        (None, [], []),
        (None, [(4, 1, 0), (6, 1, 1)], [1, 0]),
        (4, [(4, 1, 0), (6, 1, 1)], [1]),  # only a newer step is worth a copy
        (6, [(4, 1, 0), (6, 1, 1)], []),
        (2, [(6, 1, 2), (6, 3, 0), (6, 1, 1)], [0, 1, 2]),  # a tie: seq, then node rank
    ],
)
def test_fetch_order(have: int | None, offers: list[tuple[int, int, int]], want: list[int]) -> None:
    assert fetch_order(have, offers) == want


_RESTORE = """
import json, logging, sys
from datetime import timedelta
from torch.distributed import TCPStore
from stalwart.checkpoint import restore
root, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
logging.basicConfig(level=logging.INFO)
got = restore(root, rank=rank, world_size=2, store=store, timeout_s=60)
print(json.dumps(None if got is None else [got.step, got.source, float(got.state_dict["w"][0])]))
"""


def _start_restores(root: Path, folders: list[Path]) -> list[subprocess.Popen[str]]:
    """Each rank restores in its own process from its node's folder, as in a job."""
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "TORCHELASTIC_"))}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RESTORE, str(root), str(rank), str(store.port)],
            env={**env, rl.RAM_DIR_ENV: str(folder)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, folder in enumerate(folders)
    ]
    _stores.append(store)  # the store lives as long as the test's processes
    return procs


_stores: list[TCPStore] = []


def _wait_for_line(proc: subprocess.Popen[str], text: str, timeout: float = 60) -> None:
    """Read ``proc``'s stderr until a line holds ``text`` (the rest is kept for later)."""
    assert proc.stderr is not None
    seen: list[str] = []
    found = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if text in line:
                found.set()
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert found.wait(timeout), "".join(seen)[-2000:]


def _results(procs: list[subprocess.Popen[str]]) -> list[object]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=90)
        assert p.returncode == 0, stderr[-2000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    _stores.clear()
    return out


def _agree(root: Path, folders: list[Path]) -> list[object]:
    return _results(_start_restores(root, folders))


def _persist(root: Path, step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step ``step`` of both ranks on disk (outside ``stalwart run``: disk only)."""
    monkeypatch.delenv(rl.RAM_DIR_ENV, raising=False)
    for rank in range(WORLD):
        with AsyncCheckpointer(
            root, rank=rank, world_size=WORLD, config=CheckpointerConfig()
        ) as ck:
            ck.save(state(step, rank), step).result(timeout=60)


def test_a_replica_two_snapshots_behind_still_resumes_every_rank_from_ram(
    kv: C10dKV,
    make_node: Callable[..., SnapshotMemory],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, spare = make_node("a"), make_node("b"), make_node("spare")
    root = tmp_path / "ckpt"
    _persist(root, 2, monkeypatch)
    ev = Events()
    # Node a (rank 0) holds node b's (rank 1) replicas; the spare will take rank 1.
    node_a = rp.NodeReplicas(
        a.folder, a.slot_bytes, 1, 1, kv, "127.0.0.1", ev, max_nodes=3, key=KEY
    )
    spare_holder = rp.ReplicaHolder(spare.folder, spare.slot_bytes, ev, reserve=1)
    publish_owner(kv, 0, 1, 1, 1, WORLD)  # node b runs rank 1
    try:
        for step in (4, 6, 8):
            snapshot(a, 0, rank=0, step=step, world=WORLD)
            snapshot(b, 0, rank=1, step=step, world=WORLD)
            if step == 4:
                # b's stream is slow: only its step 4 reaches a before b is lost.
                src = rp.SegmentFile(b.folder / rl.segment_name(0), writable=False)
                (slot, rec), *_ = src.records()
                assert push(addr(node_a.server), src, slot, rec, 1) == ""
                src.close()
        # Node a's own segment moved on to steps 8 and 6; the replica says 4.
        assert [s.step for s in find_snapshots(a.folder, 1, WORLD)] == [4]
        # Node b is lost; the spare takes rank 1 and copies its replica from node a.
        (got,) = fetch_missing(spare_holder, [1], WORLD, {0: addr(node_a.server)}, ev)
        assert (got.step, got.from_node) == (4, 0), got
    finally:
        spare_holder.close()
        node_a.close()
    # Every rank resumes from RAM at the replica's step, not from step 2 on disk.
    assert _agree(root, [a.folder, spare.folder]) == [[4, "ram", 40.0], [4, "ram", 41.0]]


def test_a_node_holding_an_old_replica_of_a_rank_it_takes_over_fetches_a_newer_one(
    make_node: Callable[..., SnapshotMemory],
) -> None:
    a, gone, spare = make_node("a"), make_node("gone"), make_node("spare")
    ev = Events()
    srv_a, srv_spare = server(a, Events(), 0), server(spare, Events(), 2)
    spare_holder = rp.ReplicaHolder(spare.folder, spare.slot_bytes, ev)
    try:
        src = rp.SegmentFile(gone.folder / rl.segment_name(0), writable=False)
        # The spare held rank 1's replica at step 2 (an earlier ring), node a at step 6.
        for step, srv in ((2, srv_spare), (6, srv_a)):
            snapshot(gone, 0, rank=1, step=step)
            (slot, rec), *_ = src.records()
            assert push(addr(srv), src, slot, rec, 1) == ""
        src.close()
        assert replica_steps(spare.folder, 1) == [2]
        (got,) = fetch_missing(spare_holder, [1], 4, {0: addr(srv_a)}, ev)
        assert (got.rank, got.step, got.from_node) == (1, 6, 0), got
        assert replica_steps(spare.folder, 1)[0] == 6
        # As new as any peer's now: nothing more to copy.
        assert fetch_missing(spare_holder, [1], 4, {0: addr(srv_a)}, ev) == []
    finally:
        spare_holder.close()
        srv_a.close()
        srv_spare.close()


def test_a_spare_starts_its_workers_while_it_fetches_and_their_restore_waits_for_it(
    kv: C10dKV, make_node: Callable[..., SnapshotMemory], tmp_path: Path
) -> None:
    """The spare's launcher returns from ``begin_round`` at once (its workers start
    while the copy runs); a worker's restore waits until the copy is in."""
    a, b, spare = make_node("a"), make_node("b"), make_node("spare")
    ev = Events()
    srv_a = server(a, Events(), 0, world=WORLD)
    node_s = rp.NodeReplicas(
        spare.folder, spare.slot_bytes, 1, 1, kv, "127.0.0.1", ev, max_nodes=3, key=KEY
    )
    marker = spare.folder / rl.FETCHING_MARKER
    try:
        snapshot(a, 0, rank=0, step=4, world=WORLD)
        snapshot(b, 0, rank=1, step=4, world=WORLD)
        src = rp.SegmentFile(b.folder / rl.segment_name(0), writable=False)
        (slot, rec), *_ = src.records()
        assert push(addr(srv_a), src, slot, rec, 1) == ""
        src.close()
        rp.publish(kv, 1, srv_a.address(1, 0, 0, 1, WORLD))
        # Node a's server is slow to answer for rank 1: the fetch cannot finish.
        slow = srv_a.holder.lock(1)
        slow.acquire()
        try:
            returned = threading.Event()
            threading.Thread(
                target=lambda: (node_s.begin_round(1, 1, 2, 1, WORLD), returned.set()),
                daemon=True,
            ).start()
            assert returned.wait(5), "begin_round waited for the fetch"
            assert marker.exists()
            procs = _start_restores(tmp_path / "ckpt", [a.folder, spare.folder])
            _wait_for_line(procs[1], "waiting for the launcher to fetch snapshots")
        finally:
            slow.release()
        assert [(f.rank, f.step) for f in node_s.wait_fetched(30)] == [(1, 4)]
        assert not marker.exists()
        assert _results(procs) == [[4, "ram", 40.0], [4, "ram", 41.0]]
    finally:
        node_s.close()
        srv_a.close()
