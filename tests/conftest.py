"""Fixtures for every test folder; the helpers themselves are in ``tests/helpers.py``."""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests import helpers

if TYPE_CHECKING:
    from bench.netns import Network
    from stalwart.launch.snapshots import SnapshotMemory
    from stalwart.rendezvous.kv import C10dKV


@pytest.fixture(autouse=True)
def _no_launcher_outlives_its_test() -> Iterator[None]:
    """A launcher a failed test left running (a wait that timed out) is SIGKILLed, so it
    cannot hold its workers and ports through the rest of the run."""
    yield
    while helpers.STARTED:
        proc = helpers.STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture(params=["warm", "cold"])
def start_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Asked for by ``helpers.warm_and_cold``: the test runs once per start path."""
    helpers.START["warm"] = request.param == "warm"
    try:
        yield request.param
    finally:
        helpers.START["warm"] = True


@pytest.fixture
def cold_start() -> Iterator[None]:
    """Asked for by ``helpers.cold_only``: warm starts off for this test."""
    helpers.START["warm"] = False
    try:
        yield
    finally:
        helpers.START["warm"] = True


# The fixtures below serve the multi-node and replica tests of several folders; they import
# what they need when asked, so a test that uses none of them does not load torch for them.


@functools.cache
def _netns_skip() -> str | None:
    from bench.netns import netns_usable

    return netns_usable()


@pytest.fixture
def network() -> Iterator[Network]:
    """Simulated hosts, each its own network namespace (``bench/netns.py``); skipped where
    namespaces cannot be made."""
    from bench.netns import Network

    skip = _netns_skip()
    if skip:
        pytest.skip(skip)
    net = Network(f"{os.getpid() % 10000}")
    try:
        yield net
    finally:
        net.close()


@pytest.fixture
def kv() -> Iterator[C10dKV]:
    """A real ``TCPStore`` on 127.0.0.1, hosted by this process."""
    from stalwart.rendezvous.kv import C10dKV

    store = C10dKV("127.0.0.1", 0, is_host=True, connect_timeout=10, op_timeout=10)
    yield store
    store.close()


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., SnapshotMemory]]:
    """Makes a node's snapshot memory (the launcher's own class) in a folder of its own;
    every one made is closed after the test."""
    from stalwart.launch.snapshots import SnapshotMemory
    from tests.multinode.replica_helpers import SLOT

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
