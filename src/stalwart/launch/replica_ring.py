"""Which peers hold a node's replicas, and which snapshot a node fetches: decisions
only, no I/O (the rest of ``replicas`` acts on them)."""

from __future__ import annotations


def ring_targets(me: int, nodes: int, k: int, lost: frozenset[int] = frozenset()) -> list[int]:
    """The nodes that hold this node's replicas: the next ``k`` in ring order, skipping
    the ``lost`` ones (replication moves on to the node after a lost one)."""
    order = [(me + i) % nodes for i in range(1, nodes)]
    return [n for n in order if n not in lost][: max(0, k)]


def effective_replicas(flag: int | None, max_nodes: int) -> int:
    """``--ckpt-replicas``: unset means 1 when the job may have 2 or more nodes."""
    if flag is None:
        return 1 if max_nodes >= 2 else 0
    return flag
