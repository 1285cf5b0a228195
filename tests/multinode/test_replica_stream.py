"""Snapshot replicas between launchers: ring choice, the byte stream, torn and refused
replicas, a lost peer, a node out of room, and fetching the ranks a node takes over.

Real snapshot folders (the launcher's own class), real snapshots written by the worker's
code, real TCP sockets on 127.0.0.1 and a real ``TCPStore`` for the addresses.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint.ram import find_snapshots, load_snapshot
from stalwart.cli import build_config
from stalwart.config import ConfigError
from stalwart.launch.replicas import node as rp
from stalwart.launch.replicas import wire
from stalwart.launch.replicas.auth import record_mac
from stalwart.launch.replicas.snapshots import SnapshotMemory
from stalwart.rendezvous.kv import C10dKV
from tests.helpers import wait_for

from .replica_helpers import (
    KEY,
    SLOT,
    WORLD,
    Events,
    addr,
    fetch_missing,
    push,
    replica_steps,
    replicating,
    server,
    snapshot,
    state,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("me", "nodes", "k", "lost", "want"),
    [
        (0, 1, 1, set(), []),
        (0, 2, 1, set(), [1]),
        (1, 2, 1, set(), [0]),
        (2, 4, 1, set(), [3]),
        (3, 4, 2, set(), [0, 1]),
        (0, 3, 1, {1}, [2]),  # a lost peer: the next node in the ring takes over
        (0, 3, 2, {1}, [2]),
        (0, 3, 1, {1, 2}, []),
        (1, 3, 5, set(), [2, 0]),  # never more peers than there are
        (0, 3, 0, set(), []),
    ],
)
def test_ring_targets(me: int, nodes: int, k: int, lost: set[int], want: list[int]) -> None:
    assert rp.ring_targets(me, nodes, k, frozenset(lost)) == want


@pytest.mark.parametrize(
    ("flag", "max_nodes", "want"),
    [(None, 1, 0), (None, 2, 1), (None, 8, 1), (0, 4, 0), (2, 4, 2), (3, 1, 3)],
)
def test_default_replicas(flag: int | None, max_nodes: int, want: int) -> None:
    assert rp.effective_replicas(flag, max_nodes) == want


def test_newest_snapshot_reaches_the_next_node_and_loads_there(
    kv: C10dKV, make_node: Callable[..., SnapshotMemory]
) -> None:
    a, b = make_node("a", nproc=2), make_node("b", nproc=2)
    ev_a, ev_b = Events(), Events()
    with replicating(kv, a, 2, rp.Ring(0, 0, 2, 1), {1: server(b, ev_b, 1)}, ev_a):
        snapshot(a, 0, rank=0, step=3)
        snapshot(a, 1, rank=1, step=3)
        wait_for(lambda: replica_steps(b.folder, 1) == [3], 20, "rank 1's step 3 on node b")
        snapshot(a, 0, rank=0, step=4)
        snapshot(a, 1, rank=1, step=4)
        # The replica keeps two generations, like the local segment.
        wait_for(lambda: replica_steps(b.folder, 1) == [4, 3], 20, "step 4 after step 3")
        wait_for(lambda: replica_steps(b.folder, 0) == [4, 3], 20, "rank 0 too")
    (snap,) = [s for s in find_snapshots(b.folder, 1, WORLD) if s.step == 4]
    got = load_snapshot(snap)
    assert got["step"] == 4 and torch.equal(got["w"], state(4, 1)["w"])
    assert sorted(p.name for p in b.folder.glob("replica_*")) == [
        "replica_r0.snap",
        "replica_r1.snap",
    ]
    assert ev_a.kinds() == [] and ev_b.kinds() == []


def _manual_push(
    srv: rp.ReplicaServer, seg: rp.SegmentFile, slot: int, rec: rl.CommitRecord, cut: str
) -> wire.Reply | None:
    """Speak the push protocol by hand, spoiling it as ``cut`` says."""
    with rp.connect(addr(srv), KEY, 0) as sock:
        wire.send_frame(sock, wire.Push(0, wire.Manifest(rec, 0, record_mac(KEY, rec))))
        ready = wire.expect(sock, wire.Reply)
        assert isinstance(ready, wire.Reply) and ready.ok
        skel = bytes(seg.region(slot, 0, rec.skeleton_bytes))
        tensors = bytearray(seg.region(slot, rec.tensor_offset, rec.tensor_bytes))
        if cut == "flip":
            tensors[len(tensors) // 2] ^= 0xFF
        sock.sendall(skel)
        if cut == "close":
            sock.sendall(tensors[: len(tensors) // 2])
            sock.shutdown(socket.SHUT_WR)
            return None
        sock.sendall(tensors)
        wire.send_frame(sock, wire.End(cut != "changed"))
        done = wire.expect(sock, wire.Reply)
        assert isinstance(done, wire.Reply)
        return done


@pytest.mark.parametrize("cut", ["flip", "close", "changed"])
def test_a_torn_or_altered_replica_is_never_committed(
    make_node: Callable[..., SnapshotMemory], cut: str
) -> None:
    a, b = make_node("a"), make_node("b")
    srv = server(b, Events(), 1)
    try:
        snapshot(a, 0, rank=2, step=7)
        seg = rp.SegmentFile(a.folder / rl.segment_name(0), writable=False)
        (slot, rec), *_ = seg.records()
        reply = _manual_push(srv, seg, slot, rec, cut)
        if reply is not None:
            assert not reply.ok and reply.error, reply
        # The receiver holds nothing of rank 2 it would let a worker use.
        assert replica_steps(b.folder, 2) == []
        # ... and a clean push of the same snapshot afterwards is committed.
        reply = _manual_push(srv, seg, slot, rec, "")
        assert reply is not None and reply.ok, reply
        assert replica_steps(b.folder, 2) == [7]
        seg.close()
    finally:
        srv.close()


def test_a_wrong_key_or_a_garbage_frame_is_refused(
    make_node: Callable[..., SnapshotMemory],
) -> None:
    b = make_node("b")
    srv = server(b, Events(), 1)
    try:
        with pytest.raises(rp.AuthError):
            rp.connect(addr(srv), rp.job_key(b"not the secret of this job!", "job"), 0)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(b"\xff\xff\xff\x7fjunk")  # a frame length far over MAX_FRAME
            try:
                got = sock.recv(1)
            except ConnectionResetError:  # closed with the junk unread
                got = b""
            assert got == b""  # dropped, the server goes on
        assert rp.offer(addr(srv), 0, WORLD, KEY, 9) is None
    finally:
        srv.close()


def test_a_lost_peer_moves_replication_to_the_next_node(
    kv: C10dKV, make_node: Callable[..., SnapshotMemory]
) -> None:
    a, b, c = make_node("a"), make_node("b"), make_node("c")
    ev = Events()
    srv_b, srv_c = server(b, Events(), 1), server(c, Events(), 2)
    with replicating(kv, a, 1, rp.Ring(0, 0, 3, 1), {1: srv_b, 2: srv_c}, ev) as rep:
        snapshot(a, 0, rank=0, step=1)
        wait_for(lambda: replica_steps(b.folder, 0) == [1], 20, "step 1 on node 1")
        assert replica_steps(c.folder, 0) == []
        srv_b.close()  # node 1 is gone: nothing answers on its port any more
        snapshot(a, 0, rank=0, step=2)
        lost = ev.wait(rp.REPLICA_PEER_LOST)
        assert lost["lost_node"] == 1 and lost["targets"] == [2], lost
        assert "Connection refused" in lost["error"]
        wait_for(lambda: replica_steps(c.folder, 0) == [2], 20, "step 2 on node 2")
        assert rep.targets() == [2]
        # A new round forgets the loss: the ring is recomputed from who joined.
        rep.set_ring(rp.Ring(1, 0, 2, 1))
        assert rep.targets() == [1]
    assert ev.kinds().count(rp.REPLICA_PEER_LOST) == 1


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    # Room for one segment of 1 MiB slots (2 x (4 KiB + 1 MiB)) and not for a second.
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_receiver_out_of_room_refuses_with_one_event_and_the_sender_goes_on(
    kv: C10dKV, make_node: Callable[..., SnapshotMemory], tiny_tmpfs: Path
) -> None:
    a = make_node("a", nproc=2)
    b = make_node("b", base=tiny_tmpfs)  # its own local segment takes most of the room
    ev_a, ev_b = Events(), Events()
    with replicating(kv, a, 2, rp.Ring(0, 0, 2, 1), {1: server(b, ev_b, 1)}, ev_a) as rep:
        for step in (1, 2):
            snapshot(a, 0, rank=0, step=step)
            snapshot(a, 1, rank=1, step=step)
            wait_for(
                lambda want=2 * step: rep.outcomes["refused"] >= want,
                20,
                f"both pushes of step {step} answered",
            )
        no_room = ev_b.wait(rp.REPLICA_NO_ROOM)
        assert "no room for a replica of rank" in no_room["error"]
        assert "\n" not in no_room["error"]
        # One event per rank on the receiver, not one per snapshot.
        assert ev_b.kinds().count(rp.REPLICA_NO_ROOM) == 2
        # The sender, too, says so once per peer and rank, not once per snapshot.
        refused = [f for e, f in ev_a.seen if e == rp.REPLICA_REFUSED]
        assert sorted(f["rank"] for f in refused) == [0, 1], refused
        assert all(f["to_node"] == 1 and "no room" in f["error"] for f in refused)
        # Nothing half-reserved is left behind, and the sender's thread is still alive.
        assert sorted(p.name for p in b.folder.iterdir()) == ["local_0.snap", "owner.json"]
        assert rep.targets() == [1]


def test_a_node_taking_over_a_rank_fetches_the_newest_replica(
    kv: C10dKV, make_node: Callable[..., SnapshotMemory]
) -> None:
    a, b, spare = make_node("a"), make_node("b"), make_node("spare")
    ev = Events()
    srv_a, srv_b = server(a, Events(), 0), server(b, Events(), 1)
    # Reserved at start-up: the fetch takes a ready segment, it allocates nothing.
    holder = rp.ReplicaHolder(spare.folder, spare.slot_bytes, ev, reserve=1)
    (free,) = spare.folder.glob(f"{rp.FREE_PREFIX}*")
    try:
        # Node a holds rank 1's replica at step 5 and its own rank 0; node b rank 1 at step 4.
        snapshot(a, 0, rank=0, step=5)
        seg_src = make_node("gone")
        snapshot(seg_src, 0, rank=1, step=4)
        snapshot(seg_src, 0, rank=1, step=5)
        src = rp.SegmentFile(seg_src.folder / rl.segment_name(0), writable=False)
        for (slot, rec), srv in zip(src.records(), (srv_a, srv_b), strict=True):
            assert push(addr(srv), src, slot, rec, 9) == ""
        src.close()
        peers = {0: addr(srv_a), 1: addr(srv_b)}
        got = fetch_missing(holder, [1, 0], WORLD, peers, ev)
        # Rank 1: the newer of the two replicas; rank 0: a's own local snapshot.
        assert [(f.rank, f.step, f.from_node) for f in got] == [(1, 5, 0), (0, 5, 0)]
        assert ev.wait(rp.REPLICA_FETCHED)["rank"] == 1
        (snap, *_) = find_snapshots(spare.folder, 1, WORLD)
        assert snap.step == 5 and torch.equal(load_snapshot(snap)["w"], state(5, 1)["w"])
        assert not free.exists() and rp.replica_ranks(spare.folder) == [0, 1]
        # Held now: asking again fetches nothing.
        assert fetch_missing(holder, [1], WORLD, peers, ev) == []
        # A rank nobody holds: one event naming it, and the node restores from disk.
        (none,) = fetch_missing(holder, [3], WORLD, peers, ev)
        assert none.step is None and "no peer holds" in none.error
        assert ev.wait(rp.REPLICA_FETCH_FAILED)["rank"] == 3
    finally:
        holder.close()
        srv_a.close()
        srv_b.close()


def test_replica_memory_is_reserved_at_start_up_and_its_lack_is_one_event(
    make_node: Callable[..., SnapshotMemory], tiny_tmpfs: Path
) -> None:
    roomy = make_node("roomy")
    ev = Events()
    holder = rp.ReplicaHolder(roomy.folder, roomy.slot_bytes, ev, reserve=2)
    free = sorted(roomy.folder.glob(f"{rp.FREE_PREFIX}*"))
    assert len(free) == 2 and all(p.stat().st_blocks * 512 >= p.stat().st_size for p in free)
    # Not a snapshot segment: a worker looking for its snapshots never maps one.
    assert find_snapshots(roomy.folder, 0, WORLD) == []
    holder.close()
    assert ev.kinds() == []
    # Room for the node's own segment only: one line, one event, and the launcher goes on.
    tight = make_node("tight", base=tiny_tmpfs)
    holder = rp.ReplicaHolder(tight.folder, tight.slot_bytes, ev, reserve=2)
    (fields,) = [f for e, f in ev.seen if e == rp.REPLICA_NO_ROOM]
    assert fields["rank"] is None and "no room to reserve 2 replica segment(s)" in fields["error"]
    assert "\n" not in fields["error"]
    assert sorted(p.name for p in tight.folder.iterdir()) == ["local_0.snap", "owner.json"]
    holder.close()


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--ckpt-ram", "1MiB"], None),
        (["--ckpt-ram", "1MiB", "--ckpt-replicas", "2"], 2),
        (["--ckpt-ram", "1MiB", "--ckpt_replicas", "0"], 0),
        (["--ckpt-replicas", "0"], 0),  # off needs no RAM
    ],
)
def test_ckpt_replicas_flag(argv: list[str], want: int | None) -> None:
    cfg, _ = build_config([*argv, "train.py"])
    assert cfg.ckpt_replicas == want


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--ckpt-replicas", "1"], "--ckpt-replicas 1: replicas copy RAM snapshots, so it needs"),
        (["--ckpt-ram", "1MiB", "--ckpt-replicas", "-1"], "--ckpt-replicas -1: expected a count"),
        (["--ckpt-ram", "1MiB", "--ckpt-replicas", "two"], "--ckpt-replicas"),
    ],
)
def test_a_bad_ckpt_replicas_is_one_line(argv: list[str], error: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config([*argv, "train.py"])
    assert error in str(info.value) and "\n" not in str(info.value)


def test_ckpt_replicas_from_yaml(tmp_path: Path) -> None:
    conf = tmp_path / "job.yaml"
    conf.write_text("ckpt_ram: 2MiB\nckpt_replicas: 2\n")
    cfg, _ = build_config(["--config", str(conf), "train.py"])
    assert (cfg.ckpt_ram, cfg.ckpt_replicas) == (2 << 20, 2)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"rank": 4}, "rank 4 is outside world size 4"),
        ({"rank": -1}, "rank -1 is outside world size 4"),
        ({"tensor_bytes": SLOT}, "do not fit a slot"),
        ({"tensor_offset": 100}, "do not fit a slot"),
        ({"skeleton_bytes": 8192, "tensor_offset": 4096}, "do not fit a slot"),
    ],
)
def test_a_manifest_that_does_not_fit_is_refused_before_any_byte(
    make_node: Callable[..., SnapshotMemory], change: dict[str, int], error: str
) -> None:
    a, b = make_node("a"), make_node("b")
    srv = server(b, Events(), 1)
    try:
        snapshot(a, 0, rank=2, step=7)
        seg = rp.SegmentFile(a.folder / rl.segment_name(0), writable=False)
        (slot, rec), *_ = seg.records()
        bad = msgspec.structs.replace(rec, **change)
        why = push(addr(srv), seg, slot, bad, 0)
        assert error in why, why
        assert rp.replica_ranks(b.folder) == []  # nothing reserved for it
        seg.close()
    finally:
        srv.close()
