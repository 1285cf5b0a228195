"""The admission gate: what the elastic round asks before a node may join it.

The rendezvous knows nothing of why a node is refused (a failed health check, a
quarantine): it calls whatever object meets `AdmissionGate`, which the launcher builds
(``stalwart.health.admission.HealthGate``) and hands in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from stalwart.rendezvous.kv import KV


@dataclass(frozen=True)
class Admissions:
    """The gate's answer for the joiners of an open round."""

    # Kept out, and why (one line each).
    refused: Mapping[str, str] = field(default_factory=dict)
    # Not decided yet (no report so far): the round waits for them, within the gate's
    # own bound.
    pending: frozenset[str] = frozenset()


class AdmissionGate(Protocol):
    def before_join(self, kv: KV, round_: int, node: str, addr: str, peers: Sequence[str]) -> None:
        """This node is about to take a slot in *round_*; *peers* joined before it."""
        ...

    def admissions(
        self, kv: KV, round_: int, nodes: Sequence[str], running: Sequence[str] = ()
    ) -> Admissions:
        """Which of the joiners *nodes* may not join *round_* (and why), and which are
        not decided yet. *running*: while the round before it still runs, its nodes
        (the spares are judged against them too: they have not checked for *round_*)."""
        ...

    def closing(self, kv: KV, round_: int, nodes: Sequence[str]) -> None:
        """This node is about to close *round_* among the joiners *nodes*."""
        ...

    def closed(self, kv: KV, round_: int, node: str) -> str | None:
        """*round_* closed: why *node* was kept out of it, or None."""
        ...
