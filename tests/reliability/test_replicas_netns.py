"""A stranger between two simulated hosts against a job with RAM replicas.

Two namespace nodes run ``bench/ram_train.py`` with ``--ckpt-ram`` (one replica each, the
job's secret handed to both launchers out of band), each launcher at a 1,024-descriptor
limit (``prlimit``). A stranger outside both namespaces reads the job's store, pushes a
forged snapshot (step 999999, zeroed weights) of each node's own rank to that node and
asks for node 0's rank 0 snapshot, in the protocol as it was (the token from the store)
and as it is (without the key); then it holds 1,000 idle connections to node 0's replica
server (the launcher that hosts the store) and a few that trickle bytes, while rank 1's
worker is killed. Both launchers run on, the job restores its own state (from RAM) and
finishes with the model a one-process run computes. Before, the forged snapshots were
restored and the flood ended the launcher at its descriptor limit (EMFILE).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import psutil
import pytest
import torch

from bench.elastic_train import model_and_opt
from bench.netns import Host, Network, rdzv_args
from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint.ram import RamSegment
from stalwart.checkpoint.staging import plan
from stalwart.launch.replicas.snapshots import SnapshotMemory
from stalwart.rendezvous.kv import C10dKV
from tests.helpers import free_port, wait_for
from tests.multinode.replica_helpers import ram_job
from tests.multinode.test_netns import reference_state

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(300)]

STEPS = 60
FLOOD = 1000


FAST = "keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=3,join_timeout=40"


def text(out: Path, name: str) -> str:
    return (out / f"{name}.out").read_text()


def step_reached(out: Path) -> int:
    try:
        return int((out / "progress").read_text().split()[1])
    except (FileNotFoundError, ValueError, IndexError):
        return -1


def matches_reference(out: Path) -> None:
    """The job's final model is the one-process reference's (a forged state is not)."""
    got, want = torch.load(out / "final.pt"), reference_state(STEPS)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)


def frame(obj: object) -> bytes:
    body = msgspec.json.encode(obj)
    return struct.pack("<I", len(body)) + body


def launch(host: Host, out: Path, endpoint: str, name: str) -> subprocess.Popen[str]:
    return host.spawn(
        "prlimit",
        "--nofile=1024:1024",
        sys.executable,
        "-m",
        "stalwart.cli",
        "run",
        *rdzv_args(
            backend="c10d", endpoint=endpoint, nnodes="2", run_id="job", conf=FAST, max_restarts=3
        ),
        "--shutdown-timeout",
        "3",
        # The restarted job (the stranger still at the door) need not be paced.
        *ram_job(
            out / f"logs-{name}", out, STEPS, 0.2, persist_every=10, save_every=2, later_step_s=0
        ),
        log=out / f"{name}.out",
        extra_env={"STALWART_JOB_SECRET": "0123456789abcdef-netns-job-secret"},
    )


def forged_snapshot(tmp: Path, rank: int) -> tuple[dict[str, object], bytes]:
    """A snapshot in stalwart's own format: the job's model, zeroed, at step 999999."""
    model, opt = model_and_opt()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    mem = SnapshotMemory(1, 1 << 20, base=tmp)
    try:
        seg = RamSegment.open(mem.folder / rl.segment_name(0))
        rec = seg.write(
            plan({"model": model.state_dict(), "opt": opt.state_dict()}), 999_999, rank, 2
        )
        base = rl.data_offset(0, seg.slot_bytes)
        raw = seg._map
        payload = bytes(raw[base : base + rec.skeleton_bytes]) + bytes(
            raw[base + rec.tensor_offset : base + rec.tensor_offset + rec.tensor_bytes]
        )
        seg.close()
    finally:
        mem.close()
    return msgspec.to_builtins(rec), payload


def talk(addr: str, port: int, data: bytes) -> bytes:
    with socket.create_connection((addr, port), timeout=5) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(data)
        got = bytearray()
        sock.settimeout(3)
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                got += chunk
        return bytes(got)


def stranger_reads(kv: C10dKV) -> dict[int, dict[str, object]]:
    """Each node's newest published replica server, as read from the store."""
    found: dict[int, dict[str, object]] = {}
    for r in range(10):
        for node in (0, 1):
            raw = kv.get(f"replicas/r{r}/{node}")
            if raw is not None:
                # A sealed value is readable, not secret: the record follows the MAC.
                if raw.startswith(b"hmac1:"):
                    raw = raw.split(b":", 2)[2]
                found[node] = msgspec.json.decode(raw)
    return found


def test_a_stranger_between_hosts_is_refused_and_the_job_restores_its_own_state(
    network: Network,
    tmp_path: Path,
) -> None:
    a, b = network.add_host(), network.add_host()
    port = free_port()
    pa = launch(a, tmp_path, f"{a.addr}:{port}", "a")
    pb = launch(b, tmp_path, f"{a.addr}:{port}", "b")
    procs = [pa, pb]
    held: list[socket.socket] = []
    stop = threading.Event()
    try:
        wait_for(
            lambda: step_reached(tmp_path) >= 12 or any(p.poll() is not None for p in procs),
            120,
            "step 12",
        )
        assert all(p.poll() is None for p in procs), text(tmp_path, "a")[-3000:]
        kv = C10dKV(a.addr, port, is_host=False, connect_timeout=10, op_timeout=10)
        servers = stranger_reads(kv)
        assert sorted(servers) == [0, 1], servers
        answers: list[bytes] = []
        for node, srv in servers.items():
            addr, sport = str(srv["addr"]), int(str(srv["port"]))
            token = str(srv.get("token", ""))
            rank = node  # one rank per node: node n runs rank n
            rec, payload = forged_snapshot(tmp_path, rank)
            push = {
                "kind": "push",
                "token": token,
                "manifest": {"record": rec, "from_node": 1 - node},
            }
            answers.append(
                talk(addr, sport, frame(push) + payload + frame({"kind": "end", "ok": True}))
            )
            hello = {"kind": "hello", "node": 1 - node, "nonce": "ab" * 16}
            answers.append(
                talk(addr, sport, frame(hello) + frame({"kind": "proof", "proof": "cd" * 32}))
            )
            fetch = {"kind": "fetch", "token": token, "rank": 0, "world_size": 2, "send": True}
            answers.append(talk(addr, sport, frame(fetch)))
        assert not any(b'"ok":true' in got or b"offer" in got for got in answers), answers
        # The flood, on the launcher that hosts the store, and tricklers on both.
        host0, port0 = str(servers[0]["addr"]), int(str(servers[0]["port"]))
        for _ in range(FLOOD):
            try:
                held.append(socket.create_connection((host0, port0), timeout=5))
            except OSError:
                break  # the server's backlog is full: the flood is as big as it gets

        def trickle(addr: str, port: int) -> None:
            with contextlib.suppress(OSError), socket.create_connection((addr, port), 5) as s:
                for byte in frame({"kind": "hello", "node": 0, "nonce": "0" * 32}):
                    s.sendall(bytes([byte]))
                    if stop.wait(0.5):
                        return

        for srv in servers.values():
            for _ in range(3):
                threading.Thread(
                    target=trickle, args=(str(srv["addr"]), int(str(srv["port"]))), daemon=True
                ).start()
        # The job trains on with the stranger at the door, so the RAM snapshot it restores
        # is past step 12 (the full run once killed it while it was still there).
        wait_for(lambda: step_reached(tmp_path) > 14, 120, "training during the flood")
        # Rank 1's worker dies: both ranks restore, with the stranger still at the door.
        first = [json.loads(x) for x in (tmp_path / "attempts.jsonl").read_text().splitlines()]
        (victim,) = [r["pid"] for r in first if r["attempt"] == 0 and r["rank"] == 1]
        psutil.Process(int(victim)).send_signal(signal.SIGKILL)
        for p, name in ((pa, "a"), (pb, "b")):
            assert p.wait(240) == 0, text(tmp_path, name)[-4000:]
    finally:
        stop.set()
        for s in held:
            s.close()
    assert len(held) >= FLOOD // 2, len(held)
    matches_reference(tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    later = [r for r in rows if r["attempt"] != 0]
    assert sorted(r["rank"] for r in later) == [0, 1], rows
    # Its own state: a step this job reached, from RAM (newer than the disk's).
    (start,) = {r["start"] for r in later}
    assert 12 < start <= STEPS and {r["source"] for r in later} == {"ram"}, rows
    # What the stranger sent is a few rate-limited lines, not a line (or traceback) each.
    for name in ("a", "b"):
        lines = [x for x in text(tmp_path, name).splitlines() if "replica server:" in x]
        assert len(lines) <= 40, lines
