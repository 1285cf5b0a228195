"""The contract between a node's supervisor and any rendezvous backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class RendezvousError(RuntimeError):
    """The job cannot form: unreachable endpoint, id mismatch, join timeout."""


@dataclass(frozen=True)
class RendezvousInfo:
    """One node's view of a completed round."""

    round: int
    group_rank: int
    group_world_size: int
    base_rank: int  # global rank of this node's local rank 0
    world_size: int
    master_addr: str
    master_port: int
    duration: float  # seconds spent waiting for the other nodes


class Rendezvous(Protocol):
    run_id: str
    node_rank: int | None

    def join(self, round_: int, local_world_size: int) -> RendezvousInfo:
        """Blocks until every node joined *round_*; returns ranks and the worker store."""
        ...

    def report_failure(self, round_: int, failure: dict[str, Any]) -> None:
        """Tells every node that *round_* failed (this node's root-cause candidate)."""
        ...

    def failed(self, round_: int) -> bool:
        """True once any node reported a failure in *round_* (cheap: polled often)."""
        ...

    def failures(self, round_: int) -> list[dict[str, Any]]:
        """The failure records of every node that reported one in *round_*."""
        ...

    def report_done(self, round_: int) -> None:
        """This node's workers all succeeded in *round_*."""
        ...

    def all_done(self, round_: int) -> bool: ...

    def leave(self) -> None:
        """This node is exiting; the store host waits for everyone before closing."""
        ...
