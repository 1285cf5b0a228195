"""Learned timeouts: what one rank observed, the max over all ranks, times a safety factor.

Ranks exchange their observations as JSON (never pickles) through torch.distributed
when the default process group is up, otherwise through the job's store, so that every
rank computes the same timeouts. torch is imported only inside `gather_json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from stalwart.base import envvars as base_env

STATE_KEY = "stalwart_monitor"
STATE_VERSION = 1
#: The key NVIDIA's RankMonitorClient.state_dict() puts its timeouts under.
NVIDIA_STATE_KEY = "current_timeouts"


@dataclasses.dataclass
class Observations:
    """Longest intervals one rank (or, after merging, the job) has seen, in seconds."""

    hb_initial: float | None = None
    hb: float | None = None
    sections: dict[str, float] = dataclasses.field(default_factory=dict)
    oos: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Observations:
        def num(value: Any) -> float | None:
            # A peer's JSON may carry Infinity or NaN: neither is an interval.
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
                and value >= 0
            ):
                return float(value)
            return None

        sections_raw = data.get("sections") or {}
        sections = {
            str(k): v
            for k, v in ((k, num(v)) for k, v in dict(sections_raw).items())
            if v is not None
        }
        return cls(num(data.get("hb_initial")), num(data.get("hb")), sections, num(data.get("oos")))


def _max(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def merge_max(all_obs: list[Observations]) -> Observations:
    names = sorted({name for obs in all_obs for name in obs.sections})
    return Observations(
        hb_initial=_max(o.hb_initial for o in all_obs),
        hb=_max(o.hb for o in all_obs),
        sections={
            n: v for n in names if (v := _max(o.sections.get(n) for o in all_obs)) is not None
        },
        oos=_max(o.oos for o in all_obs),
    )


@dataclasses.dataclass
class LearnedTimeouts:
    """Timeouts computed by the ranks; None where nothing was learned (config applies)."""

    hb_initial: float | None = None
    hb: float | None = None
    sections: dict[str, float] = dataclasses.field(default_factory=dict)
    oos: float | None = None

    def to_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"version": STATE_VERSION}
        if self.hb is not None:
            state["heartbeat"] = {"initial": self.hb_initial, "subsequent": self.hb}
        if self.sections:
            state["sections"] = dict(sorted(self.sections.items()))
        if self.oos is not None:
            state["out_of_section"] = self.oos
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> LearnedTimeouts:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported learned-timeouts state version {state.get('version')!r}")

        def secs(value: Any, what: str) -> float | None:
            if value is None:
                return None
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 < value < math.inf
            ):
                raise ValueError(
                    f"learned timeout {what} must be a finite number > 0 of seconds, "
                    f"got {str(value)[:40]!r}"
                )
            return float(value)

        hb = state.get("heartbeat") or {}
        sections_raw = state.get("sections") or {}
        if not isinstance(hb, Mapping) or not isinstance(sections_raw, Mapping):
            raise ValueError(
                "learned timeouts: 'heartbeat' and 'sections' must be objects, got "
                f"{type(hb).__name__} and {type(sections_raw).__name__}"
            )
        sections = {str(k): secs(v, repr(k)) for k, v in sections_raw.items()}
        return cls(
            hb_initial=secs(hb.get("initial"), "initial heartbeat"),
            hb=secs(hb.get("subsequent"), "heartbeat"),
            sections={k: v for k, v in sections.items() if v is not None},
            oos=secs(state.get("out_of_section"), "out-of-section"),
        )


def _nvidia_secs(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{NVIDIA_STATE_KEY}: {what} must be > 0 seconds or null, got {value!r}")
    return float(value)


def _nvidia_part(state: Mapping[str, Any], key: str, fields: set[str]) -> Mapping[str, Any]:
    part = state.get(key)
    if part is None:
        return {}
    if not isinstance(part, Mapping):
        raise ValueError(f"{NVIDIA_STATE_KEY}[{key!r}] must be a mapping, got {part!r}")
    unknown = sorted(set(map(str, part)) - fields)
    if unknown:
        raise ValueError(
            f"{NVIDIA_STATE_KEY}[{key!r}] has unknown key(s) {', '.join(unknown)}; "
            f"expected {', '.join(sorted(fields))}"
        )
    return part


def from_nvidia_state(state: Any) -> LearnedTimeouts:
    """The timeouts NVIDIA's RankMonitorClient had *calculated*, from the value it stored
    under "current_timeouts". Values it had only from its config are not carried over:
    under stalwart the node's config supplies those."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{NVIDIA_STATE_KEY} must be a mapping, got {state!r}")
    unknown = sorted(set(map(str, state)) - {"heartbeat", "section"})
    if unknown:
        raise ValueError(
            f"{NVIDIA_STATE_KEY} has unknown key(s) {', '.join(unknown)}; "
            "expected heartbeat, section"
        )
    out = LearnedTimeouts()
    hb = _nvidia_part(state, "heartbeat", {"initial", "subsequent", "were_calculated"})
    if hb.get("were_calculated", True):
        out.hb = _nvidia_secs(hb.get("subsequent"), "heartbeat subsequent")
        initial = _nvidia_secs(hb.get("initial"), "heartbeat initial")
        if out.hb is not None:
            out.hb_initial = max(initial or out.hb, out.hb)
    sec = _nvidia_part(
        state,
        "section",
        {"section", "out_of_section", "calculated_sections", "is_out_of_section_calculated"},
    )
    table = sec.get("section")
    table = {} if table is None else table
    calculated = sec.get("calculated_sections")
    calculated = [] if calculated is None else calculated
    if not isinstance(table, Mapping) or not isinstance(calculated, list | tuple | set):
        raise ValueError(
            f"{NVIDIA_STATE_KEY}['section']: 'section' must be a mapping and "
            f"'calculated_sections' a list, got {table!r} and {calculated!r}"
        )
    for name in calculated:
        secs = _nvidia_secs(table.get(name), f"section {name!r}")
        if secs is not None:
            out.sections[str(name)] = secs
    if sec.get("is_out_of_section_calculated"):
        out.oos = _nvidia_secs(sec.get("out_of_section"), "out_of_section")
    return out


def gather_json(payload: dict[str, Any], store: Any | None, seq: int) -> list[dict[str, Any]]:
    """Every rank's `payload`, in rank order.

    Through torch.distributed when the default group is up; else through `store`; else
    through the store the launcher hosts for the job (torchrun and stalwart set
    TORCHELASTIC_USE_AGENT_STORE with MASTER_ADDR/MASTER_PORT); with a single process
    and none of these, just our own payload.
    """
    data = json.dumps(payload, separators=(",", ":")).encode()
    dist = _initialised_dist()
    if dist is not None:
        return [json.loads(raw) for raw in _gather_bytes_dist(dist, data)]
    world = int(os.environ.get(base_env.WORLD_SIZE, "1"))
    if store is None and world > 1:
        store = _agent_store()
    if store is not None:
        rank = int(os.environ.get(base_env.RANK, "0"))
        prefix = f"stalwart/monitor/learn/{seq}"
        store.set(f"{prefix}/{rank}", data)
        return [json.loads(bytes(store.get(f"{prefix}/{r}"))) for r in range(world)]
    if world > 1:
        raise RuntimeError(
            "learned timeouts must agree across ranks: initialise torch.distributed first, "
            "pass store= to RankMonitorClient, or run under a launcher that hosts the job store"
        )
    return [payload]


_agent_store_cache: dict[tuple[int, str, int], Any] = {}


def _agent_store() -> Any | None:
    """A client of the launcher-hosted job store, or None when there is none."""
    if os.environ.get(base_env.USE_AGENT_STORE, "").lower() != "true":
        return None
    host, port = os.environ.get(base_env.MASTER_ADDR), os.environ.get(base_env.MASTER_PORT)
    if not host or not port:
        return None
    key = (os.getpid(), host, int(port))
    if key not in _agent_store_cache:
        import datetime

        import torch.distributed as dist

        tcp_store: Any = dist.TCPStore  # type: ignore[attr-defined]  # public, untyped re-export
        _agent_store_cache[key] = tcp_store(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=300)
        )
    return _agent_store_cache[key]


def _initialised_dist() -> Any | None:
    import sys

    # Only look at torch if the program already imported it: we never pull torch in.
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _gather_bytes_dist(dist: Any, data: bytes) -> list[bytes]:
    import torch

    from stalwart.base.pgdevice import group_device

    device = group_device()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    size = int(length.item())
    mine = torch.zeros(size, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [bytes(t.cpu().tolist()).rstrip(b"\0") for t in everyone]
