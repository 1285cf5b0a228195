"""Per-iteration rendezvous stores for training code that calls ``init_process_group()``.

Lives on the store-hosting rank; the wrapper publishes each store's port under
``it<n>/port`` and exports it as ``MASTER_PORT`` for iteration ``n``.
"""

from __future__ import annotations

import datetime

from torch._C._distributed_c10d import TCPStore


class IterationStores:
    """On the store host: one fresh TCPStore server per iteration for ``env://`` users.

    Each iteration's ``init_process_group`` then meets an empty, already
    listening store (as a client, like under a torchrun agent), so no key of a
    failed iteration is ever read and no rank waits for a server to come up.
    """

    def __init__(self) -> None:
        self._stores: dict[int, TCPStore] = {}

    def open(self, iteration: int) -> int:
        store = TCPStore(
            "0.0.0.0",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=300),
            use_libuv=True,
        )
        self._stores[iteration] = store
        return int(store.port)

    def close_before(self, iteration: int) -> None:
        for it in [i for i in self._stores if i < iteration]:
            del self._stores[it]

    def close(self) -> None:
        self._stores.clear()
