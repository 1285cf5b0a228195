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


def fetch_order(have_step: int | None, offers: list[tuple[int, int, int]]) -> list[int]:
    """The nodes to fetch a rank's snapshot from, best first, given the ``(step, seq,
    node)`` each offers and the step this node holds already (None: nothing): only a
    newer step is worth the copy, the newest first (seq breaks a tie within a node's
    segment; between nodes the lower node rank)."""
    newer = [o for o in offers if have_step is None or o[0] > have_step]
    return [node for _, _, node in sorted(newer, key=lambda o: (-o[0], -o[1], o[2]))]


def owner_problem(owned: tuple[int, int, int] | None, node: int, rank: int, world: int) -> str:
    """Why node ``node`` may not push a snapshot of ``rank`` in a world of ``world`` ranks
    ('' when it may), given ``(first rank, ranks, world size)`` of the node's verified
    address in the push's round (None: it published none)."""
    if owned is None:
        return f"node {node} published no verified address for that round"
    first, count, world_size = owned
    if world != world_size:
        return f"world size {world} is not the round's ({world_size})"
    if not first <= rank < first + count:
        return f"rank {rank} is not node {node}'s (it runs {first} to {first + count - 1})"
    return ""
