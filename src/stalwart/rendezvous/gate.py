"""The admission gate: what the elastic round asks before a node may join it.

The rendezvous knows nothing of why a node is refused (a failed health check, a
quarantine): it calls whatever object meets `AdmissionGate`, which the launcher builds
(``stalwart.health.admission.HealthGate``) and hands in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from stalwart.rendezvous.kv import KV


class AdmissionGate(Protocol):
    def before_join(self, kv: KV, round_: int, node: str, addr: str, peers: Sequence[str]) -> None:
        """This node is about to take a slot in *round_*; *peers* joined before it."""
        ...

    def refused(self, kv: KV, round_: int, nodes: Sequence[str]) -> Mapping[str, str]:
        """Which of the joiners *nodes* may not join *round_*, and why."""
        ...

    def closing(self, kv: KV, round_: int, nodes: Sequence[str]) -> None:
        """This node is about to close *round_* among the joiners *nodes*."""
        ...

    def closed(self, kv: KV, round_: int, node: str) -> str | None:
        """*round_* closed: why *node* was kept out of it, or None."""
        ...
