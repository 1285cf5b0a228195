"""A stranger on the in-process wrapper's store (a real ``TCPStore``; anyone who reaches
its port): the records the wrapper reads back (the iteration's port, the fault record,
the interruption records, a barrier's result) are refused when they are not well
formed, in range and of a bounded size, instead of steering a rank to the stranger's
port or raising out of the wait that keeps the store up for the other ranks. Under
`stalwart run` the launcher gives the workers a key (a 0600 file, never the job's
secret), and then even a well-formed record of the stranger's is refused."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import PrefixStore, Store, TCPStore

from stalwart.base.liveness import CounterWatch
from stalwart.base.sealed import worker_seal, write_worker_key
from stalwart.inprocess.state import Interruption, InterruptionRecord
from stalwart.inprocess.store import CoordStore

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(60)]

HUGE = "7" * (600 * 1024)  # over every limit a reader has (16 KiB, 512 KiB)


def _landed(stranger: Store, *keys: str) -> None:
    """A set is not answered: a read on the stranger's own connection is, once the
    server handled the sets before it; only then does the test's read prove anything."""
    for key in keys:
        stranger.get(key)


@pytest.fixture
def stores() -> Iterator[tuple[CoordStore, Store]]:
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    client = TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=10))
    # A silent rank counts as gone after 0.5 s: a refused barrier result ends soon.
    coord = CoordStore(host, 0, CounterWatch[int](0.5))
    # The stranger writes the very keys the wrapper reads (it can list them all).
    yield coord, PrefixStore(coord.namespace, client)


@pytest.mark.parametrize("forged", ["99999", "0", "-1", "abc", " 80", "8e3", "٣٣", HUGE, ""])
def test_a_forged_port_is_refused(stores: tuple[CoordStore, Store], forged: str) -> None:
    coord, stranger = stores
    stranger.set("it3/port", forged)
    _landed(stranger, "it3/port")  # else the host's value below could land first
    assert coord.port(3) is None
    # The host's own value replaces the stranger's.
    coord.publish_port(3, 29511)
    assert coord.port(3) == 29511


GOOD = InterruptionRecord(1, 2, Interruption.EXCEPTION, "boom").to_json().decode()


@pytest.mark.parametrize(
    "forged",
    [
        "not json",
        '{"rank": 1}',
        '{"rank": 1, "iteration": 2, "kind": "no such kind"}',
        '{"rank": "x", "iteration": 2, "kind": "exception"}',
        '{"rank": -4, "iteration": 2, "kind": "exception"}',
        # A genuine-looking record of another iteration, moved here.
        '{"rank": 1, "iteration": 7, "kind": "exception"}',
        "[" * 200_000,
        '{"rank": 1, "iteration": 2, "kind": "exception", "message": "' + HUGE + '"}',
        "\u0000\u0001",
    ],
)
def test_a_forged_fault_record_is_refused(stores: tuple[CoordStore, Store], forged: str) -> None:
    coord, stranger = stores
    stranger.set("it2/fault", forged)
    stranger.set("it2/int/1", forged)
    _landed(stranger, "it2/fault", "it2/int/1")
    assert coord.fault(2) is None
    assert coord.interruptions(2, range(2)) == []


def test_without_a_key_a_well_formed_record_reads(stores: tuple[CoordStore, Store]) -> None:
    # Plain torchrun: no launcher gave a key, so the store is as open as torchrun's own.
    coord, stranger = stores
    stranger.set("it2/fault", GOOD)
    _landed(stranger, "it2/fault")
    assert coord.fault(2) == InterruptionRecord(1, 2, Interruption.EXCEPTION, "boom")


@pytest.fixture
def sealed(tmp_path: Path) -> Iterator[tuple[CoordStore, CoordStore, Store]]:
    """Two ranks holding the launcher's key (read from its 0600 file), and a stranger."""
    env = write_worker_key(tmp_path, b"k" * 32, "job")
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    client = TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=10))
    other = TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=10))
    me = CoordStore(host, 0, CounterWatch[int](5.0), seal=worker_seal(env))
    peer = CoordStore(client, 1, CounterWatch[int](5.0), seal=worker_seal(env))
    yield me, peer, PrefixStore(me.namespace, other)


def test_with_the_launchers_key_well_formed_forgeries_are_refused(
    sealed: tuple[CoordStore, CoordStore, Store],
) -> None:
    me, peer, stranger = sealed
    # Everything a rank obeys: a fault (every rank restarts), the port (where env://
    # connects), a rank's exit or termination (the store host stops waiting for it),
    # a rank number, a completion, a barrier's arrival and result.
    for key, value in [
        ("it2/fault", GOOD),
        ("it2/int/1", GOOD),
        ("it2/port", "29511"),
        ("left/1", "1"),
        ("term/1", "forged"),
        ("it2/placed/1", "0"),
        ("it2/anycompleted", "1"),
    ]:
        stranger.set(key, value)
        _landed(stranger, key)
    assert me.fault(2) is None
    assert me.interruptions(2, range(2)) == []
    assert me.port(2) is None
    assert not me.has_left(1) and not me.is_terminated(1)
    assert me.placed_ranks(2, [1], 2) == {}
    assert not me.any_completed(2)
    # The peer's own records read back.
    peer.record_interruption(InterruptionRecord(1, 3, Interruption.EXCEPTION, "real"))
    peer.publish_port(3, 29512)
    peer.record_left()
    assert me.fault(3) == InterruptionRecord(1, 3, Interruption.EXCEPTION, "real")
    assert me.port(3) == 29512 and me.has_left(1)


def test_with_the_launchers_key_a_barrier_is_not_released_by_a_stranger(
    sealed: tuple[CoordStore, CoordStore, Store],
) -> None:
    me, _, stranger = sealed
    # Rank 1 has not arrived: a forged arrival, an inflated counter and a forged result
    # must not end rank 0's wait (rank 1 is not yet gone: 5 s without a heartbeat).
    stranger.set("b/y/a/1", "1")
    stranger.add("b/y/n", 5)
    stranger.set("b/y/done", "[]")
    _landed(stranger, "b/y/a/1", "b/y/done")
    from stalwart.inprocess.errors import BarrierTimeout

    with pytest.raises(BarrierTimeout):
        me.barrier("y", [0, 1], timeout=1.0)


@pytest.mark.parametrize("problem", ["symlink", "mode", "content"])
def test_a_key_file_that_is_not_the_launchers_is_a_one_line_error(
    tmp_path: Path, problem: str
) -> None:
    env = write_worker_key(tmp_path, b"k" * 32, "job")
    path = Path(env["STALWART_WORKER_KEY_FILE"])
    if problem == "symlink":
        link = tmp_path / "link.key"
        link.symlink_to(path)
        env = {"STALWART_WORKER_KEY_FILE": str(link)}
    elif problem == "mode":
        path.chmod(0o644)
    else:
        path.write_text("zz" * 32)
    with pytest.raises(ValueError, match="STALWART_WORKER_KEY_FILE") as err:
        worker_seal(env)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("forged", ["{}", "[1, 2, 99]", '["a"]', "nope", "[" * 200_000])
def test_a_forged_barrier_result_ends_the_barrier_without_raising(
    stores: tuple[CoordStore, Store], forged: str
) -> None:
    coord, stranger = stores
    stranger.set("b/x/done", forged)
    _landed(stranger, "b/x/done")
    gone = coord.barrier("x", [0, 1], timeout=5.0)
    assert gone <= {1}
