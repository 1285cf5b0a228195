"""The launcher's side of what node monitors share: the job's store, as the monitor
sees it (`monitor.jobsync.JobStore`). The monitor never imports the rendezvous; this
adapts the store the rendezvous already runs on (c10d TCPStore or etcd) and names the
round's peers."""

from __future__ import annotations

from typing import Any

from stalwart.monitor.jobsync import JobPeers
from stalwart.rendezvous.api import Rendezvous, RendezvousInfo
from stalwart.rendezvous.kv import KV


class _RendezvousStore:
    """The rendezvous's key-value engine under the monitor's three calls; its errors
    (``StoreLost``) pass through: the monitor logs them, the supervisor acts on them."""

    def __init__(self, kv: KV) -> None:
        self._kv = kv

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return self._kv.get_many(keys)

    def set(self, key: str, value: str) -> None:
        self._kv.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self._kv.add(key, amount)


def job_peers(rdzv: Rendezvous | None, info: RendezvousInfo) -> JobPeers | None:
    """The round's peers for the node monitor; None for a one-node round, or a
    rendezvous that runs on no key-value store of ours (nothing to share through)."""
    kv: Any = getattr(rdzv, "kv", None)
    if rdzv is None or kv is None or info.group_world_size < 2:
        return None
    return JobPeers(
        store=_RendezvousStore(kv),
        round=info.round,
        node_rank=info.group_rank,
        nnodes=info.group_world_size,
        elastic=bool(rdzv.elastic),
    )
