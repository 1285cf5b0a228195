"""A rank's heartbeat after the store's host died: one failed call, then none.

torch's ``TCPStore`` client never reconnects, and each failed call formats the socket's
addresses through reverse DNS. Beating on would only load the resolver, and a beat stuck in
its timeout while the process exits aborts it ("terminate called without an active
exception") instead of ending with the rank's own code."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed import TCPStore

from stalwart.base.liveness import CounterWatch
from stalwart.inprocess.progress import Periodic
from stalwart.inprocess.store import CoordStore
from tests.helpers import store_host_process

pytestmark = pytest.mark.timeout(60)


class _Counted(dist.Store):
    """A real store client, counting the heartbeats that reach it."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.adds = 0

    def add(self, key: str, amount: int) -> int:
        self.adds += 1
        return int(self.inner.add(key, amount))


def test_a_heartbeat_stops_calling_a_store_whose_host_died() -> None:
    with store_host_process() as (host, port):
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        counted = _Counted(client)
        coord = CoordStore(counted, 0, CounterWatch[int](5.0))
        coord.heartbeat()
        assert coord.heartbeat_value(0) == 1
        host.kill()
        host.wait(timeout=30)
        with pytest.raises(dist.DistNetworkError):
            coord.heartbeat()
        reached = counted.adds
        for _ in range(20):
            with pytest.raises(RuntimeError, match="the store connection was lost: "):
                coord.heartbeat()
        assert counted.adds == reached == 3
        # The background thread that beats it keeps going and stops when told.
        beats = Periodic("heartbeat", coord.heartbeat, 0.01)
        beats.start()
        beats.stop()
        assert not beats.is_alive()
        assert counted.adds == reached
