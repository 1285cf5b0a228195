"""A stranger against a launcher's replica server: real sockets, a real ``TCPStore``, real
snapshot segments. Whatever it reads in the store (it has no authentication), it cannot
fetch a rank's weights, push a snapshot, make the server allocate, redirect a node's
pushes to itself, or get more than one log line per kind of trouble; a node of the job
cannot push a rank it does not run; a DCP shard set whose record was altered, or that
holds another job's steps, never becomes what a rank restores. And a multi-node job with
replicas and no secret is a one-line error at start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from stalwart import runlog
from stalwart.base.events import Event
from stalwart.checkpoint import dcp as sdcp
from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint.dcp_ram import snapshot_step
from stalwart.checkpoint.dcp_records import DcpCommit, RankShards
from stalwart.checkpoint.dcp_storage import DcpReader, read_record
from stalwart.checkpoint.ram import RamSegment
from stalwart.cli import build_config
from stalwart.config import ConfigError
from stalwart.config.secret import JOB_SECRET_ENV
from stalwart.launch.replicas import auth, wire
from stalwart.launch.replicas import node as rp
from stalwart.launch.replicas.snapshots import SnapshotMemory
from stalwart.rendezvous.kv import C10dKV
from tests.helpers import read_events, wait_for
from tests.multinode.replica_helpers import (
    KEY,
    SLOT,
    WORLD,
    Events,
    publish_owner,
    replica_steps,
    server,
    snapshot,
)

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(90)]


def raw_frame(obj: object) -> bytes:
    body = msgspec.json.encode(obj)
    return struct.pack("<I", len(body)) + body


def recv_all(sock: socket.socket, limit: int = 1 << 22) -> bytes:
    """Whatever the server sends until it closes (or goes quiet for 3 s)."""
    sock.settimeout(3)
    got = bytearray()
    try:
        while len(got) < limit:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return bytes(got)


def published(kv: C10dKV, round_: int, node: int) -> dict[str, object]:
    """What a stranger reads of a node's replica server in the store."""
    raw = kv.get(rp.STORE_KEY.format(round=round_, node=node))
    assert raw is not None
    out: dict[str, object] = msgspec.json.decode(raw)
    return out


def segment_record(mem: SnapshotMemory) -> tuple[rp.SegmentFile, int, rl.CommitRecord]:
    seg = rp.SegmentFile(mem.folder / rl.segment_name(0), writable=False)
    (slot, rec), *_ = seg.records()
    return seg, slot, rec


# -- the secret at start ----------------------------------------------------------------
MULTI = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400"]


def test_multi_node_replicas_without_a_secret_is_one_line_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(JOB_SECRET_ENV, raising=False)
    monkeypatch.delenv("STALWART_JOB_SECRET_FILE", raising=False)
    with pytest.raises(ConfigError) as info:
        build_config([*MULTI, "--ckpt-ram", "1MiB", "train.py"])
    msg = str(info.value)
    assert JOB_SECRET_ENV in msg and "--job-secret-file" in msg and "\n" not in msg
    # No replicas, or one node: nothing to prove to anyone.
    build_config([*MULTI, "--ckpt-ram", "1MiB", "--ckpt-replicas", "0", "train.py"])
    build_config(["--ckpt-ram", "1MiB", "train.py"])
    monkeypatch.setenv(JOB_SECRET_ENV, secrets.token_hex(16))
    build_config([*MULTI, "--ckpt-ram", "1MiB", "train.py"])


@pytest.mark.parametrize(
    ("content", "mode", "error"),
    [
        (b"short", 0o600, "a job secret of 5 bytes; expected 16 to 4096"),
        (b"x" * 5000, 0o600, "expected 16 to 4096"),
        (b"0123456789abcdef0123", 0o666, "another user can write it"),
        (None, 0o600, "expected a readable file"),
        ("dir", 0o700, "not a regular file"),
    ],
)
def test_a_bad_secret_file_is_one_line(
    tmp_path: Path, content: bytes | str | None, mode: int, error: str
) -> None:
    path = tmp_path / "secret"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
        os.chmod(path, mode)
    with pytest.raises(ConfigError) as info:
        build_config([*MULTI, "--ckpt-ram", "1MiB", "--job-secret-file", str(path), "train.py"])
    assert error in str(info.value) and "\n" not in str(info.value), info.value
    assert str(path) in str(info.value)


def test_a_good_secret_file_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    cfg, _ = build_config(
        [*MULTI, "--ckpt-ram", "1MiB", "--job-secret-file", str(path), "train.py"]
    )
    assert cfg.job_secret_file == path


# -- the stranger on the wire ------------------------------------------------------------
def test_a_stranger_with_the_store_cannot_fetch_or_push(
    kv: C10dKV, make_node: Callable[..., SnapshotMemory]
) -> None:
    """It reads the server's published address and speaks the protocol as it was (a
    token from the store) and as it is (without the key): no byte of a snapshot comes
    back, nothing is allocated, the forged snapshot is never committed."""
    a, stranger = make_node("a"), make_node("stranger")
    ev = Events()
    srv = server(a, ev, 0)
    try:
        snapshot(a, 0, rank=0, step=7)  # the node's own rank: its weights
        rp.publish(kv, 0, srv.address(0, 0, 0, 1, WORLD))
        seen = published(kv, 0, 0)
        host, port = str(seen["addr"]), int(str(seen["port"]))
        token = str(seen.get("token", ""))
        snapshot(stranger, 0, rank=1, step=999_999)
        seg, slot, forged = segment_record(stranger)
        record = msgspec.to_builtins(forged)
        payload = bytes(seg.region(slot, 0, forged.skeleton_bytes)) + bytes(
            seg.region(slot, forged.tensor_offset, forged.tensor_bytes)
        )
        seg.close()
        own, own_slot, own_rec = segment_record(a)
        weights = bytes(own.region(own_slot, own_rec.tensor_offset, 4096))
        own.close()
        # The old protocol: a fetch with the token read from the store.
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(
                raw_frame(
                    {"kind": "fetch", "token": token, "rank": 0, "world_size": WORLD, "send": True}
                )
            )
            got = recv_all(sock)
        assert weights not in got and b"offer" not in got, got[:200]
        # ... and a push of a forged snapshot, bytes and all.
        with socket.create_connection((host, port), timeout=5) as sock:
            manifest = {"record": record, "from_node": 1}
            sock.sendall(raw_frame({"kind": "push", "token": token, "manifest": manifest}))
            with contextlib.suppress(OSError):
                sock.sendall(payload + raw_frame({"kind": "end", "ok": True}))
            got = recv_all(sock)
        assert b'"ok":true' not in got, got
        # The protocol as it is, with a guessed key: the proof is wrong.
        guess = auth.job_key(secrets.token_bytes(32), "job")
        with pytest.raises(wire.WireError):
            rp.connect(rp.PeerAddress(host, port, 0, 0, 1, WORLD), guess, 1)
        with socket.create_connection((host, port), timeout=5) as sock:
            nonce = secrets.token_hex(16)
            sock.sendall(raw_frame({"kind": "hello", "node": 1, "nonce": nonce}))
            challenge = wire.expect(sock, wire.Challenge)
            assert isinstance(challenge, wire.Challenge)
            sock.sendall(raw_frame({"kind": "proof", "proof": secrets.token_hex(32)}))
            sock.sendall(raw_frame({"kind": "push", "round": 0, "manifest": manifest}))
            got = recv_all(sock)
        assert got == b"", got
        # Nothing of rank 1 was allocated, let alone committed; rank 0's is untouched.
        assert rp.replica_ranks(a.folder) == [] and replica_steps(a.folder, 1) == []
        assert sorted(p.name for p in a.folder.iterdir()) == ["local_0.snap", "owner.json"]
    finally:
        srv.close()


def test_a_forged_address_in_the_store_gets_no_snapshot(
    kv: C10dKV, make_node: Callable[..., SnapshotMemory]
) -> None:
    """A stranger overwrites node 1's published address with its own listener: the
    sender ignores it (its MAC differs); pointed at it anyway, the sender finds the
    listener cannot prove it is of the job and sends nothing of the snapshot."""
    a = make_node("a")
    snapshot(a, 0, rank=0, step=7)
    seg, slot, rec = segment_record(a)
    with socket.create_server(("127.0.0.1", 0)) as trap:
        port = trap.getsockname()[1]
        fake = {"addr": "127.0.0.1", "port": port, "node": 1, "first_rank": 1, "nranks": 1}
        fake |= {"world_size": WORLD, "mac": "0" * 64}
        kv.set(rp.STORE_KEY.format(round=0, node=1), msgspec.json.encode(fake).decode())
        assert rp.lookup(kv, 0, [1], KEY) == {}
        caught: list[bytes] = []

        def listen() -> None:
            conn, _ = trap.accept()
            with conn:
                conn.settimeout(5)
                caught.append(conn.recv(65536))
                # Answer as a stranger would: a challenge it cannot prove.
                conn.sendall(raw_frame({"kind": "challenge", "nonce": "a" * 32, "proof": "b" * 64}))
                caught.append(recv_all(conn))

        t = threading.Thread(target=listen, daemon=True)
        t.start()
        peer = rp.PeerAddress("127.0.0.1", port, 1, 1, 1, WORLD)
        with pytest.raises(rp.PeerGone):
            rp.push(peer, seg, slot, rec, rp.Ring(0, 0, 2, 1), KEY)
        t.join(10)
    seg.close()
    sent = b"".join(caught)
    assert b"hello" in sent and b"push" not in sent and b"record" not in sent, sent


def test_a_node_of_the_job_cannot_push_a_rank_it_does_not_run(
    kv: C10dKV, make_node: Callable[..., SnapshotMemory]
) -> None:
    a, b = make_node("a"), make_node("b")
    ev = Events()
    node_a = rp.NodeReplicas(a.folder, SLOT, 1, 1, kv, "127.0.0.1", ev, max_nodes=2, key=KEY)
    try:
        node_a.begin_round(0, 0, 2, 0, 2)
        publish_owner(kv, 0, 1, 1, 1, 2)  # node 1 runs rank 1 of 2
        snapshot(b, 0, rank=0, step=5, world=2)  # ... but sends a snapshot of rank 0
        seg, slot, rec = segment_record(b)
        target = rp.lookup(kv, 0, [0], KEY)[0]
        why = rp.push(target, seg, slot, rec, rp.Ring(0, 1, 2, 1), KEY)
        assert "rank 0 is not node 1's" in why, why
        # Sent as another node, or with a record whose MAC does not hold: refused too.
        with rp.connect(target, KEY, 1) as sock:
            man = wire.Manifest(rec, 0, auth.record_mac(KEY, rec))
            wire.send_frame(sock, wire.Push(0, man))
            reply = wire.expect(sock, wire.Reply)
        assert isinstance(reply, wire.Reply) and "sent as node 0 by node 1" in reply.error
        snapshot(b, 0, rank=1, step=6, world=2)
        seg.close()
        seg, slot, rec = segment_record(b)
        with rp.connect(target, KEY, 1) as sock:
            tampered = msgspec.structs.replace(rec, step=999_999)
            man = wire.Manifest(tampered, 1, auth.record_mac(KEY, rec))
            wire.send_frame(sock, wire.Push(0, man))
            reply = wire.expect(sock, wire.Reply)
        assert isinstance(reply, wire.Reply) and "MAC differs" in reply.error, reply
        assert rp.replica_ranks(a.folder) == []  # nothing allocated for any of it
        # Its own rank, told truly, is taken.
        assert rp.push(target, seg, slot, rec, rp.Ring(0, 1, 2, 1), KEY) == ""
        assert rp.replica_ranks(a.folder) == [1]
        seg.close()
    finally:
        node_a.close()


@pytest.mark.parametrize(
    "change",
    [
        {"kind": rl.KIND_STATE},
        {"step": 999},
        {"rank": 3},
        {"world_size": 8},
        {"tensor_bytes": 1},
        {"tensor_hash": 1},
        {"skeleton_hash": 1},
        {"created_unix": 1.5},
    ],
)
def test_the_record_mac_covers_every_field_but_seq(change: dict[str, object]) -> None:
    rec = rl.CommitRecord(
        rl.FORMAT, 2, 0, 1, 1, 10, 0, 4096, 100, 7, 0.0, rl.KIND_DCP
    )  # fmt: skip
    mac = auth.record_mac(KEY, rec)
    assert auth.record_ok(KEY, msgspec.structs.replace(rec, seq=9), mac)  # holders renumber
    assert not auth.record_ok(KEY, msgspec.structs.replace(rec, **change), mac)  # type: ignore[arg-type]


def _dcp_step(root: Path, step: int, value: float) -> tuple[dict[str, torch.Tensor], object]:
    """A one-rank DCP step of ``root`` written through stalwart, and its metadata."""
    state = {"w": torch.full((4096,), value), "b": torch.arange(16.0) + value}
    return state, sdcp.save(state, root, step, ram=False)


def test_a_forged_shard_set_replica_is_refused_and_the_job_loads_from_disk(
    make_node: Callable[..., SnapshotMemory],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Node a serves replicas; rank 0's shard sets come from node b. A stranger's push, a
    record altered after its MAC, and another job's steps (MACed by a node of the job:
    the server sees bytes, not roots) never become what rank 0 restores: it loads from
    disk. The same push of the job's own step is then restored from RAM."""
    a, b = make_node("a"), make_node("b")
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    saved, meta = _dcp_step(ours, 1, 1.0)
    _, their_meta = _dcp_step(theirs, 5, 5.0)
    srv = server(a, Events(), 0, world=1)
    target = srv.address(0, 0, 0, 1, 1)
    ring = rp.Ring(0, 1, 2, 1)

    def stage(
        root: Path, step: int, metadata: object
    ) -> tuple[rp.SegmentFile, int, rl.CommitRecord]:
        seg = RamSegment.open(b.folder / rl.segment_name(0))
        try:
            folder = root / f"step_{step:09d}"
            shards = read_record(folder / "__0_.stalwart.json", RankShards).files
            save = read_record(folder / "stalwart.commit.json", DcpCommit).save
            snapshot_step(seg, root, step, shards, metadata, 0, 1, save)  # type: ignore[arg-type]
        finally:
            seg.close()
        return segment_record(b)

    events = tmp_path / "events.jsonl"
    events.touch()
    monkeypatch.setenv(runlog.EVENTS_FILE_ENV, str(events))
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(a.folder))

    def restore() -> tuple[int | None, str]:
        """What stalwart's loader restores, from where; plain ``dcp.load`` through
        ``DcpReader`` must take the same source."""
        sources: list[str] = []
        for plain in (False, True):
            fresh = {"w": torch.zeros(4096), "b": torch.zeros(16)}
            if plain:
                dcp.load(fresh, storage_reader=DcpReader(ours / "step_000000001"))
            else:
                step = sdcp.load_newest(fresh, ours)
            assert all(torch.equal(fresh[k], saved[k]) for k in saved), fresh
            sources.append(
                [
                    e["source"]
                    for e in read_events(events)
                    if e["event"] == Event.CHECKPOINT_RESTORED
                ][-1]
            )
            events.write_text("")
        assert sources[0] == sources[1], sources
        return step, sources[0]

    try:
        seg, slot, rec = stage(ours, 1, meta)
        assert rec.kind == rl.KIND_DCP
        # A stranger (no key) cannot push it; a node of the job cannot alter the record.
        with pytest.raises(rp.PeerGone):
            rp.push(target, seg, slot, rec, ring, auth.job_key(secrets.token_bytes(32), "job"))
        for change in ({"kind": rl.KIND_STATE}, {"step": 9}, {"world_size": 2}):
            with rp.connect(target, KEY, 1) as sock:
                forged = msgspec.structs.replace(rec, **change)  # type: ignore[arg-type]
                wire.send_frame(
                    sock, wire.Push(0, wire.Manifest(forged, 1, auth.record_mac(KEY, rec)))
                )
                reply = wire.expect(sock, wire.Reply)
            assert isinstance(reply, wire.Reply) and "MAC differs" in reply.error, reply
        seg.close()
        assert rp.replica_ranks(a.folder) == []  # nothing allocated for any of it
        assert restore() == (1, "disk")
        # Another job's step 5, MACed: held, but rank 0 restores step 1 from disk.
        seg, slot, rec = stage(theirs, 5, their_meta)
        assert rp.push(target, seg, slot, rec, ring, KEY) == ""
        seg.close()
        assert rp.replica_ranks(a.folder) == [0]
        # Another folder's set is skipped quietly (a segment may hold two checkpointers'
        # folders by right); what matters is that rank 0 does not load it.
        assert restore() == (1, "disk")
        # The job's own step, pushed the same way, is what rank 0 restores, from RAM.
        seg, slot, rec = stage(ours, 1, meta)
        assert rp.push(target, seg, slot, rec, ring, KEY) == ""
        seg.close()
        assert restore() == (1, "ram")
    finally:
        srv.close()


HOSTILE = [
    b"\x00\x00\x00\x00",  # an empty frame
    struct.pack("<I", 11) + b"not json!!!",
    raw_frame({"kind": "nonsense"}),
    raw_frame({"kind": "hello", "node": -5, "nonce": "0" * 32}),
    raw_frame({"kind": "hello", "node": 10**30, "nonce": "0" * 32}),
    raw_frame({"kind": "hello", "node": 1, "nonce": "\x1b[31m" * 40}),
    raw_frame({"kind": "hello", "node": 1, "nonce": "0" * 32, "x": [[[[[[[[[[[]]]]]]]]]]]}),
    raw_frame([[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]),
    struct.pack("<I", 0xFFFFFFFF) + b"x" * 100,  # a length far over MAX_FRAME
    raw_frame({"kind": "fetch", "rank": 0, "world_size": 4, "send": True}),  # before auth
    b"\xff" * 3,  # a cut-off length
    "é\u202e\n".encode() * 1000,
]


def test_hostile_frames_are_one_line_each_and_the_server_serves_on(
    make_node: Callable[..., SnapshotMemory], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = make_node("a"), make_node("b")
    ev = Events()
    srv = server(a, ev, 0)
    try:
        with caplog.at_level(logging.DEBUG, logger="stalwart.launch"):
            for _ in range(3):
                for junk in HOSTILE:
                    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
                        with contextlib.suppress(OSError):
                            sock.sendall(junk)
                            sock.shutdown(socket.SHUT_WR)
                        recv_all(sock)
        lines = [r for r in caplog.records if r.name.startswith("stalwart.launch.replica")]
        # One line per kind of trouble in the rate-limit window, never a traceback.
        kinds = [e.get("reason") for k, e in ev.seen if k == rp.REPLICA_CONN_REFUSED]
        assert len(lines) == len(kinds) <= 3, [r.getMessage() for r in lines]
        assert all(r.exc_info is None and "\n" not in r.getMessage() for r in lines)
        assert all("\x1b" not in r.getMessage() for r in lines)
        # The server still takes a good push.
        snapshot(b, 0, rank=2, step=3)
        seg, slot, rec = segment_record(b)
        assert (
            rp.push(srv.address(0, 0, 0, 1, WORLD), seg, slot, rec, rp.Ring(0, 1, 2, 1), KEY) == ""
        )
        seg.close()
        assert replica_steps(a.folder, 2) == [3]
        wait_for(lambda: srv.connections() == 0, 10, "the server connections to end")
    finally:
        srv.close()


def test_idle_and_slow_peers_are_cut_and_a_flood_holds_no_descriptors(
    make_node: Callable[..., SnapshotMemory],
) -> None:
    """200 idle connections and a peer that trickles its hello a byte a second: the
    server serves at most its cap, closes the rest at once, cuts the slow ones at the
    handshake deadline, and a good push gets through meanwhile."""
    a, b = make_node("a"), make_node("b")
    srv = server(a, Events(), 0)
    own = len(os.listdir("/proc/self/fd"))
    idle: list[socket.socket] = []
    try:
        for _ in range(200):
            idle.append(
                socket.create_connection(
                    ("127.0.0.1", srv.port), timeout=5, source_address=("127.0.0.2", 0)
                )
            )
        trickle = socket.create_connection(
            ("127.0.0.1", srv.port), timeout=5, source_address=("127.0.0.3", 0)
        )
        idle.append(trickle)
        hello = raw_frame({"kind": "hello", "node": 1, "nonce": "0" * 32})
        t0 = time.monotonic()
        cut_at: list[float] = []

        def drip() -> None:
            try:
                for byte in hello:
                    trickle.sendall(bytes([byte]))
                    time.sleep(1.0)
            except OSError:
                pass
            cut_at.append(time.monotonic() - t0)

        threading.Thread(target=drip, daemon=True).start()
        wait_for(
            lambda: srv.connections() <= rp.MAX_PER_HOST + 1,
            20,
            "the server to hold one host to its cap",
            0.05,
        )
        # The server's own descriptors: the cap, not the flood (the test holds the 201).
        assert len(os.listdir("/proc/self/fd")) - own <= 201 + rp.MAX_CONNECTIONS + 5
        # A node of the job, from another address, is served meanwhile.
        snapshot(b, 0, rank=2, step=3)
        seg, slot, rec = segment_record(b)
        peer = rp.PeerAddress("127.0.0.1", srv.port, 0, 0, 1, WORLD)
        assert rp.push(peer, seg, slot, rec, rp.Ring(0, 1, 2, 1), KEY) == ""
        seg.close()
        # The trickler is cut at the handshake deadline, long before its hello is whole.
        wait_for(lambda: cut_at, 20, "the trickler to be cut", 0.1)
        assert cut_at[0] < auth.HANDSHAKE_S + 5, cut_at
    finally:
        for s in idle:
            s.close()
        srv.close()
