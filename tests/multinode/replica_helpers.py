"""What the replica tests share: snapshot folders written by the worker's own code,
a recorder of emitted events, and a replica server over a folder."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import torch

from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint.ram import RamSegment, find_snapshots
from stalwart.checkpoint.staging import plan
from stalwart.launch.replicas import node as rp
from stalwart.launch.replicas.auth import address_mac
from stalwart.launch.replicas.snapshots import SnapshotMemory
from tests.helpers import ROOT, clean_env, stalwart_argv

SLOT = 1 << 20
WORLD = 4
RAM_TRAIN = ROOT / "bench" / "ram_train.py"


def start_job(log: Path, *args: str | Path) -> subprocess.Popen[str]:
    """``stalwart run ARGS`` on this host in a session of its own (a test can kill the
    launcher's whole group), its output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(
            stalwart_argv(*args),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=clean_env(),
            cwd=ROOT,
            start_new_session=True,
        )


def ram_job(
    log_dir: Path,
    out: Path,
    steps: int,
    step_s: float,
    persist_every: int,
    save_every: int | None = None,
    later_step_s: float | None = None,
) -> list[str | Path]:
    """The end of a ``stalwart run`` line that trains ``bench/ram_train.py`` with 1 MiB of
    RAM snapshots a rank: the log folder, then the program and its arguments (a snapshot
    every ``save_every`` steps, every ``persist_every``-th of them on disk; steps after a
    restart paced at ``later_step_s``, if given, instead of ``step_s``)."""
    every = ["--save-every", str(save_every)] if save_every is not None else []
    if later_step_s is not None:
        every += ["--later-step-s", str(later_step_s)]
    return ["--ckpt-ram", "1MiB", "--log-dir", log_dir, RAM_TRAIN, str(steps), out,
            "--step-s", str(step_s), *every, "--persist-every", str(persist_every)]  # fmt: skip


class Events:
    """Collects what a component emits, and lets a test wait for a kind."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self._cond = threading.Condition()

    def __call__(self, event: str, **fields: Any) -> dict[str, Any]:
        with self._cond:
            self.seen.append((event, fields))
            self._cond.notify_all()
        return fields

    def wait(self, kind: str, timeout: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for ev, fields in self.seen:
                    if ev == kind:
                        return fields
                left = deadline - time.monotonic()
                assert left > 0, f"no {kind} event; saw {self.seen}"
                self._cond.wait(left)

    def kinds(self) -> list[str]:
        with self._cond:
            return [ev for ev, _ in self.seen]


def state(step: int, rank: int) -> dict[str, Any]:
    return {"w": torch.full((50_000,), float(step * 10 + rank)), "step": step}


def snapshot(mem: SnapshotMemory, lr: int, rank: int, step: int, world: int = WORLD) -> None:
    seg = RamSegment.open(mem.folder / rl.segment_name(lr))
    try:
        seg.write(plan(state(step, rank)), step, rank, world)
    finally:
        seg.close()


def replica_steps(folder: Path, rank: int) -> list[int]:
    return [s.step for s in find_snapshots(folder, rank, WORLD) if "replica" in s.path.name]


KEY = rp.job_key(b"replica-tests-secret-0123456789", "job")


def anyone(world: int) -> Callable[[int, int], rp.PeerAddress]:
    """Published addresses of nodes that each run every rank of ``world`` (tests of the
    stream; the ownership rule has its own)."""
    return lambda round_, node: rp.PeerAddress("", 0, node, 0, world, world)


def server(
    mem: SnapshotMemory,
    events: Events,
    node: int,
    peer_of: Callable[[int, int], rp.PeerAddress | None] | None = None,
    *,
    world: int = WORLD,
) -> rp.ReplicaServer:
    holder = rp.ReplicaHolder(mem.folder, mem.slot_bytes, events)
    owners = anyone(world) if peer_of is None else peer_of
    return rp.ReplicaServer(holder, "127.0.0.1", lambda: node, KEY, owners, events)


def publish_owner(kv: rp.KVLike, round_: int, node: int, first: int, n: int, world: int) -> None:
    """Node ``node``'s address in the store as its launcher would publish it (MACed)."""
    plain = rp.PeerAddress("127.0.0.1", 1, node, first, n, world)
    rp.publish(
        kv, round_, msgspec.structs.replace(plain, mac=address_mac(KEY, *plain.fields(round_)))
    )


def addr(srv: rp.ReplicaServer, node: int = 0, round_: int = 0) -> rp.PeerAddress:
    return srv.address(round_, node, 0, 1, WORLD)


def push(
    peer: rp.PeerAddress, seg: rp.SegmentFile, slot: int, rec: rl.CommitRecord, me: int
) -> str:
    return rp.push(peer, seg, slot, rec, rp.Ring(0, me, 2, 1), KEY)


def fetch_missing(
    holder: rp.ReplicaHolder,
    ranks: list[int],
    world: int,
    peers: dict[int, rp.PeerAddress],
    events: Events,
) -> list[rp.Fetched]:
    return rp.fetch_missing(holder, ranks, world, peers, events, KEY, 99)


@contextmanager
def replicating(
    kv: rp.KVLike,
    sender: SnapshotMemory,
    nproc: int,
    ring: rp.Ring,
    receivers: dict[int, rp.ReplicaServer],
    events: Events,
) -> Iterator[rp.Replicator]:
    """``sender``'s replicator on ``ring``, the receivers' servers published for it;
    the replicator and the servers are closed after."""
    for node, srv in receivers.items():
        rp.publish(kv, ring.round, srv.address(ring.round, node, 0, 1, WORLD))
    rep = rp.Replicator(sender.folder, nproc, kv, events, KEY, poll_s=0.02)
    try:
        rep.set_ring(ring)
        yield rep
    finally:
        rep.close()
        for srv in receivers.values():
            srv.close()
