"""The quarantined nodes of a run, read back from its ``node_quarantined`` and
``node_released`` events: for the closing block, ``stalwart report`` and the metrics.
Pure over event records that ``event_schema`` accepted."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from stalwart.base.events import Event
from stalwart.base.records import clip, printable


@dataclass(frozen=True)
class Kept:
    node: str
    since_attempt: int | None
    reason: str
    released: bool = False


def quarantines(events: Iterable[dict[str, Any]]) -> list[Kept]:
    """Every node quarantined in the run, in order, with whether it was released since."""
    kept: dict[str, Kept] = {}
    for ev in events:
        node = ev.get("node")
        if not isinstance(node, str):
            continue
        if ev.get("event") == Event.NODE_QUARANTINED:
            since = ev.get("since_attempt")
            reason = ev.get("reason")
            kept[node] = Kept(
                node,
                since if isinstance(since, int) else None,
                reason if isinstance(reason, str) else "",
            )
        elif ev.get("event") == Event.NODE_RELEASED and node in kept:
            old = kept[node]
            kept[node] = Kept(old.node, old.since_attempt, old.reason, released=True)
    return list(kept.values())


def quarantine_lines(events: Iterable[dict[str, Any]]) -> list[str]:
    """One line per quarantined node, control characters made visible."""
    lines = []
    for k in quarantines(events):
        since = "" if k.since_attempt is None else f" (attempt {k.since_attempt})"
        what = k.reason or f"node {k.node} was quarantined{since}"
        lines.append(
            printable(clip(f"quarantined: {what}{'; released' if k.released else ''}", 400))
        )
    return lines
