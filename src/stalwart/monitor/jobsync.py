"""What the node monitors of one job share through the job's store: learned timeouts
and step rhythm.

The monitor never imports the launcher or the rendezvous: the launcher hands it a
`JobStore` (three calls of its rendezvous store) and a `JobPeers` per round. Every key
the monitors use is spelled here, under ``monitor/r<round>/``:

* ``learned/<node>``: the node's learned timeouts, in the ``learned_timeouts.json``
  format; written when they change. ``learned_version`` is a counter each write bumps,
  so that a node reads the others' values only when one of them changed (one store call
  per poll otherwise, however many nodes).
* ``rhythm/<node>``: the node's seconds per step per global rank over its last
  straggler window, written once a window.

Per-round keys: a node's rank may change between rounds, and a dead round's values are
never read again; a node publishes what it knows again in every round. Everything read
back comes from a store anyone who reaches it can write: it is decoded into typed
records, range-checked, and dropped (logged once per key) when it does not fit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from typing import Annotated, Protocol

import msgspec

from stalwart.monitor.judge import override_ok
from stalwart.monitor.learned import LearnedTimeouts

log = logging.getLogger(__name__)

#: Largest value read back from the store (learned timeouts or a rhythm summary).
MAX_VALUE_BYTES = 64 * 1024
#: Seconds between two looks at the job's learned-timeouts counter.
SYNC_EVERY = 0.5


class JobStore(Protocol):
    """The job's key-value store as the monitor uses it (the launcher adapts its own)."""

    def get_many(self, keys: list[str]) -> list[bytes | None]: ...

    def set(self, key: str, value: str) -> None: ...

    def add(self, key: str, amount: int) -> int: ...


@dataclasses.dataclass(frozen=True)
class JobPeers:
    """The job as one round formed it: where to share, and who this node is."""

    store: JobStore
    round: int
    node_rank: int
    nnodes: int
    #: Whether the job can go on without a node (elastic membership): only then does
    #: ``straggler_restart`` exclude the straggler's node.
    elastic: bool = False


def _prefix(round_: int) -> str:
    return f"monitor/r{round_}/"


def learned_key(round_: int, node: int) -> str:
    return f"{_prefix(round_)}learned/{node}"


def learned_version_key(round_: int) -> str:
    return f"{_prefix(round_)}learned_version"


def rhythm_key(round_: int, node: int) -> str:
    return f"{_prefix(round_)}rhythm/{node}"


PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]


class NodeRhythm(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One node's straggler window: seconds per step of each of its ranks that moved.
    seq counts the node's windows in the round (clocks of two hosts are never compared:
    a reader notes when it saw seq change, on its own clock)."""

    host: str
    window: PositiveSeconds
    step_times: dict[Annotated[int, msgspec.Meta(ge=0)], PositiveSeconds]
    seq: Annotated[int, msgspec.Meta(ge=0)] = 0

    def encode(self) -> str:
        return msgspec.json.encode(self).decode()


def encode_learned(learned: LearnedTimeouts) -> str:
    return json.dumps(learned.to_state(), sort_keys=True, separators=(",", ":"))


def decode_learned(raw: bytes) -> LearnedTimeouts:
    """Learned timeouts from the store or the run folder; ValueError (one line) when
    they do not fit: too large, not the format, or a value out of range."""
    if len(raw) > MAX_VALUE_BYTES:
        raise ValueError(f"larger than {MAX_VALUE_BYTES} bytes")
    try:
        state = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"not JSON: {err}") from None
    if not isinstance(state, dict):
        raise ValueError("not a JSON object")
    try:
        learned = LearnedTimeouts.from_state(state)
    except (TypeError, AttributeError, OverflowError) as err:
        raise ValueError(f"not the learned-timeouts format: {err}") from None
    values = [learned.hb, learned.oos, *learned.sections.values()]
    if any(v is not None and not override_ok(v) for v in values):
        raise ValueError("a timeout out of range")
    return LearnedTimeouts(hb=learned.hb, sections=learned.sections, oos=learned.oos)


def _no_constant(name: str) -> float:
    # JSON has no NaN or Infinity; Python's json reads them. An infinite learned timeout
    # would switch the hang check off, so they are refused rather than read.
    raise json.JSONDecodeError(f"{name} is not a number JSON allows", name, 0)


def at_least(learned: LearnedTimeouts, floor: float) -> tuple[LearnedTimeouts, list[str]]:
    """*learned* with every timeout raised to *floor* (``auto_floor``: no learned value
    is ever below it), and the names of those it raised. A value read back from the run
    folder or a peer below the floor would stop a healthy rank."""
    raised: list[str] = []

    def up(value: float | None, name: str) -> float | None:
        if value is not None and value < floor:
            raised.append(f"{name}={value:g}")
            return floor
        return value

    sections = {n: v for n, v in ((n, up(v, repr(n))) for n, v in learned.sections.items())}
    out = LearnedTimeouts(
        hb_initial=up(learned.hb_initial, "initial heartbeat"),
        hb=up(learned.hb, "heartbeat"),
        sections={n: v for n, v in sections.items() if v is not None},
        oos=up(learned.oos, "out-of-section"),
    )
    return out, raised


def decode_rhythm(raw: bytes) -> NodeRhythm:
    if len(raw) > MAX_VALUE_BYTES:
        raise ValueError(f"larger than {MAX_VALUE_BYTES} bytes")
    try:
        rhythm = msgspec.json.decode(raw, type=NodeRhythm)
    except msgspec.DecodeError as err:
        raise ValueError(str(err)) from None
    if not all(math.isfinite(v) for v in (rhythm.window, *rhythm.step_times.values())):
        raise ValueError("a number that is not finite")
    return rhythm


@dataclasses.dataclass
class Freshness:
    """Which other nodes' windows are recent enough to compare with: one whose ``seq``
    has not moved for `stale_after` seconds (its ranks finished or stopped: the hang
    checks' business) is left out, so nobody is compared with a time long gone."""

    stale_after: float
    seen: dict[int, tuple[int, float]] = dataclasses.field(default_factory=dict)

    def fresh(self, node: int, seq: int, now: float) -> bool:
        last = self.seen.get(node)
        if last is None or last[0] != seq:
            self.seen[node] = (seq, now)
            return True
        return now - last[1] <= self.stale_after


def pool_rhythms(
    mine: NodeRhythm, node: int, others: Sequence[tuple[int, NodeRhythm]]
) -> tuple[dict[int, float], dict[int, str]]:
    """The job's seconds per step by global rank, and each rank's host: this node's own
    window as measured, the others' latest. A global rank claimed by another node too
    keeps this node's value (its own ranks it knows); between two others, the lower
    node wins (each reads the same, so every node pools alike)."""
    steps = dict(mine.step_times)
    hosts = dict.fromkeys(mine.step_times, mine.host)
    for other, rhythm in sorted(others, key=lambda item: item[0]):
        if other == node:
            continue
        for rank, secs in rhythm.step_times.items():
            if rank not in steps:
                steps[rank] = secs
                hosts[rank] = rhythm.host
    return steps, hosts
