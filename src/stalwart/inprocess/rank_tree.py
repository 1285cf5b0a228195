"""NVIDIA ``inprocess`` 0.4's topology-tree rank assignment: ``Tree``, ``Layer``, ``LayerFlag``.

The ranks are the leaves of a tree whose levels are the ``Layer``s: every rank computes
one key per layer (a JSON value, or a function of its ``State`` giving one), and ranks
with equal keys under the same parent share a branch.  The first layer is the root, so
every rank must give it the same key.

The decision is ``first_seats`` (who starts active, bounded by each branch's
``max_ranks``) and ``reassign`` (after ranks were terminated): pure functions over the
``Topology`` and one ``Seat`` per rank, in the tree's depth-first leaf order.  After a
fault, in order: a branch left with fewer than ``min_ranks`` healthy ranks is terminated
whole; a terminated active rank hands its number to the reserve that became a reserve
last in the nearest ``RESERVE`` branch above it (climbing while the branches are
``RESERVE``); the others are filled, within the widest ``BACKFILL`` branch above them, by
the branch's highest active numbers; the numbers still missing are closed by shifting
every higher number down; ``world_size_filter`` may then send the top numbers to the
reserve.  ``Tree`` holds the seats between calls and exchanges keys once, at its first
call, through ``ctx.store``.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import heapq
import itertools
import json
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from datetime import timedelta
from typing import Any, NamedTuple, Protocol

from .assignment import RankAssignmentCtx
from .errors import RankDiscarded, RestartError
from .state import Mode, State

#: Largest group key, as JSON text, a rank may publish for one layer.
KEY_LIMIT = 4096
#: Store key under which each rank publishes its entry (below the wrapper's namespace).
STORE_PREFIX = "stalwart/rank_tree"
_POLL_MIN = 0.002
_POLL_MAX = 0.05


class LayerFlag(enum.Flag):
    """How a branch of a layer may be searched for a replacement.

    ``RESERVE``: a reserve (inactive) rank of the branch may take a terminated active
    rank's number.  ``BACKFILL``: the branch's highest active rank may take it."""

    RESERVE = enum.auto()
    BACKFILL = enum.auto()


@dataclasses.dataclass
class Layer:
    """One level of the tree: each branch keeps at least ``min_ranks`` healthy ranks
    (or is terminated whole) and at most ``max_ranks`` active ones (``None``: no limit).

    Mutable, as NVIDIA's: code may adjust ``flag`` or ``max_ranks`` before the first
    call; they are checked then."""

    min_ranks: int = 1
    max_ranks: int | None = None
    key_or_fn: Any = ""
    flag: LayerFlag | None = None


@dataclasses.dataclass(frozen=True)
class LayerRule:
    """A ``Layer``'s limits as checked and frozen at the tree's first call."""

    min_ranks: int
    max_ranks: int | None
    flag: LayerFlag

    @classmethod
    def of(cls, index: int, layer: object) -> LayerRule:
        if not isinstance(layer, Layer):
            raise TypeError(f"layer {index} must be a rank_assignment.Layer, got {layer!r}")
        lo, hi, flag = layer.min_ranks, layer.max_ranks, layer.flag
        if type(lo) is not int or lo < 0:
            raise ValueError(f"layer {index}: min_ranks must be an integer >= 0, got {lo!r}")
        if hi is not None and (type(hi) is not int or hi < 0):
            raise ValueError(
                f"layer {index}: max_ranks must be an integer >= 0 or None, got {hi!r}"
            )
        if flag is not None and not isinstance(flag, LayerFlag):
            raise ValueError(f"layer {index}: flag must be a LayerFlag or None, got {flag!r}")
        return cls(lo, hi, flag if flag is not None else LayerFlag(0))


class Entry(NamedTuple):
    """What one rank publishes: its current and initial rank and its key per layer
    (canonical JSON text, the root's first)."""

    rank: int
    initial_rank: int
    keys: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Branch:
    """A non-leaf node: its depth (0 = root) and its leaves, ``lo`` to ``hi`` (exclusive),
    in depth-first order (a branch's leaves are always contiguous there)."""

    depth: int
    lo: int
    hi: int


@dataclasses.dataclass(frozen=True)
class Topology:
    """The tree as every rank builds it from the same entries.

    ``leaves`` are initial ranks in depth-first order; ``above[i]`` the branches over
    leaf ``i``, nearest first, the root last; ``backfill[i]`` the widest ``BACKFILL``
    branch reachable from leaf ``i`` through ``BACKFILL`` branches, if any."""

    rules: tuple[LayerRule, ...]
    branches: tuple[Branch, ...]
    leaves: tuple[int, ...]
    above: tuple[tuple[int, ...], ...]
    backfill: tuple[int | None, ...]


class Seat(NamedTuple):
    """One rank's place as the tree decided it (a named tuple: a tree of 16k ranks makes
    16k of them per call, and a frozen dataclass costs several times more to build).

    ``rank``/``world_size`` count every live rank, reserves included (``rank`` is None once
    terminated); ``active_rank``/``active_world_size`` are the numbers the function sees
    (``active_rank`` None unless active); ``reserve_order`` says when it last became a
    reserve: the latest is called first."""

    rank: int | None
    world_size: int
    active_rank: int | None
    active_world_size: int
    mode: Mode
    reserve_order: int = -1


@dataclasses.dataclass(frozen=True)
class TreeLeaf:
    """A leaf of ``Tree.init_rank_map``: the seat of one initial rank."""

    initial_rank: int
    state: Seat


# -- building the topology ------------------------------------------------------------


def group_key(layer: int, value: object) -> str:
    """A layer's key as canonical JSON text (equal keys, equal text); ``ValueError`` naming
    the value when it is not JSON or is longer than ``KEY_LIMIT``."""
    try:
        text = json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as err:
        raise ValueError(f"layer {layer}: group key {value!r:.80} is not JSON ({err})") from None
    if len(text) > KEY_LIMIT:
        raise ValueError(
            f"layer {layer}: group key is {len(text)} characters of JSON, over {KEY_LIMIT}"
        )
    return text


def build_topology(rules: Sequence[LayerRule], entries: Sequence[Entry]) -> Topology:
    """The tree of ``entries`` (one per rank, in rank order): branches in the order their
    first rank appears, as NVIDIA's.  ``RestartError`` when the ranks disagree on the root."""
    if not rules:
        raise ValueError("Tree needs at least one Layer (the root)")
    roots = sorted({e.keys[0] for e in entries})
    if len(roots) != 1:
        raise RestartError(
            "every rank must give the root layer the same key, got "
            f"{len(roots)} different ones: {', '.join(r[:40] for r in roots[:4])}"
        )
    branches: list[Branch] = []
    order: list[Entry] = []
    above: list[tuple[int, ...]] = []
    backfill: list[int | None] = []
    fills = [bool(rule.flag & LayerFlag.BACKFILL) for rule in rules]

    def walk(group: list[Entry], depth: int, path: tuple[int, ...]) -> None:
        index = len(branches)
        branches.append(Branch(depth, len(order), -1))
        path = (index, *path)
        if depth + 1 == len(rules):
            # Every leaf of a lowest branch has the same branches above it.
            widest = None
            for b in path:
                if not fills[branches[b].depth]:
                    break
                widest = b
            for entry in group:
                order.append(entry)
                above.append(path)
                backfill.append(widest)
        else:
            children: dict[str, list[Entry]] = {}
            for entry in group:
                children.setdefault(entry.keys[depth + 1], []).append(entry)
            for child in children.values():
                walk(child, depth + 1, path)
        branches[index] = dataclasses.replace(branches[index], hi=len(order))

    walk(list(entries), 0, ())
    for position, entry in enumerate(order):
        if position != entry.rank:
            warnings.warn(
                f"the ranks' order does not match the Tree's topology: rank {entry.rank} "
                f"is leaf {position}; ranks are renumbered in the topology's order",
                UserWarning,
                stacklevel=4,
            )
            break
    return Topology(
        tuple(rules),
        tuple(branches),
        tuple(e.initial_rank for e in order),
        tuple(above),
        tuple(backfill),
    )


# -- the decision ----------------------------------------------------------------------


def first_seats(topology: Topology, ranks: Sequence[int], world_size: int) -> tuple[Seat, ...]:
    """Before any fault: leaves are activated in depth-first order while every branch
    above has fewer than its ``max_ranks`` active; the rest become reserves.  ``ranks``
    are the leaves' current ranks."""
    active = [0] * len(topology.branches)
    # No limit is a limit no count reaches.
    limit = [
        len(topology.leaves) + 1 if cap is None else cap
        for cap in (topology.rules[b.depth].max_ranks for b in topology.branches)
    ]
    placed: list[tuple[int | None, int]] = []  # (active rank, reserve order)
    counter = 0
    reserves = 0
    for chain in topology.above:
        if all(active[b] < limit[b] for b in chain):
            placed.append((counter, -1))
            counter += 1
            for b in chain:
                active[b] += 1
        else:
            placed.append((None, reserves))
            reserves += 1
    return tuple(
        Seat(
            rank=rank,
            world_size=world_size,
            active_rank=number,
            active_world_size=counter,
            mode=Mode.ACTIVE if number is not None else Mode.INACTIVE,
            reserve_order=order,
        )
        for rank, (number, order) in zip(ranks, placed, strict=True)
    )


def _propagate(topology: Topology, gone: list[bool]) -> None:
    """Deepest branches first: a branch with fewer than ``min_ranks`` leaves left loses
    them all (which its parent then counts)."""
    depths = sorted({b.depth for b in topology.branches}, reverse=True)
    for depth in depths:
        left = [0, *itertools.accumulate(0 if g else 1 for g in gone)]
        for branch in topology.branches:
            if branch.depth != depth:
                continue
            if left[branch.hi] - left[branch.lo] < topology.rules[depth].min_ranks:
                for i in range(branch.lo, branch.hi):
                    gone[i] = True


@dataclasses.dataclass
class _Work:
    """The seats being rewritten during one ``reassign`` (local to the call)."""

    active: list[int | None]
    mode: list[Mode]
    order: list[int]
    active_world_size: int


def _take_reserves(topology: Topology, work: _Work, lost: Sequence[int]) -> set[int]:
    """Hand each lost active number to the latest reserve of the nearest ``RESERVE``
    branch above; the leaves whose number was taken over."""
    pools: dict[int, list[int]] = {}
    for b, branch in enumerate(topology.branches):
        if topology.rules[branch.depth].flag & LayerFlag.RESERVE:
            idle = [i for i in range(branch.lo, branch.hi) if work.mode[i] is Mode.INACTIVE]
            pools[b] = sorted(idle, key=lambda i: work.order[i])
    handled: set[int] = set()
    for leaf in lost:
        for b in topology.above[leaf]:
            if b not in pools:
                break
            pool = pools[b]
            while pool and work.mode[pool[-1]] is not Mode.INACTIVE:
                pool.pop()  # activated through another branch already
            if pool:
                chosen = pool.pop()
                work.mode[chosen] = Mode.ACTIVE
                work.active[chosen] = work.active[leaf]
                handled.add(leaf)
                break
    return handled


def _backfill(topology: Topology, work: _Work, unhandled: Sequence[int]) -> list[int]:
    """Within each ``BACKFILL`` domain the highest active numbers move into the lost
    ones; the numbers left empty afterwards (to be closed by shifting)."""
    emptied: list[int] = []
    domains: dict[int, list[int]] = {}
    for leaf in unhandled:
        domain = topology.backfill[leaf]
        if domain is None:
            emptied.append(work.active[leaf] or 0)
        else:
            domains.setdefault(domain, []).append(leaf)
    for domain, lost in domains.items():
        branch = topology.branches[domain]
        candidates = [i for i in range(branch.lo, branch.hi) if work.mode[i] is Mode.ACTIVE]
        highest = heapq.nlargest(len(lost), candidates, key=lambda i: work.active[i] or 0)
        movers = list(reversed(highest))
        for k, leaf in enumerate(lost):
            if k < len(movers):
                emptied.append(work.active[movers[k]] or 0)
                work.active[movers[k]] = work.active[leaf]
            else:
                emptied.append(work.active[leaf] or 0)
    return emptied


def reassign(
    topology: Topology,
    seats: Sequence[Seat],
    terminated: Set[int],
    world_size_filter: Callable[[int], int] | None = None,
) -> tuple[Seat, ...]:
    """The seats after the ranks ``terminated`` (current numbers) left.

    ``ValueError`` for a terminated number that is not a live rank, or a filter that
    answers other than an integer from 0 to the active world size."""
    position = {s.rank: i for i, s in enumerate(seats) if s.rank is not None}
    unknown = sorted(r for r in terminated if r not in position)
    if unknown:
        raise ValueError(
            f"terminated ranks {unknown[:8]} are not live ranks of the tree "
            f"(0 to {len(position) - 1})"
        )
    gone = [s.mode is Mode.TERMINATED for s in seats]
    for r in terminated:
        gone[position[r]] = True
    _propagate(topology, gone)
    fresh = [i for i, g in enumerate(gone) if g and seats[i].mode is not Mode.TERMINATED]
    fresh.sort(key=lambda i: seats[i].rank or 0)
    work = _Work(
        active=[s.active_rank for s in seats],
        mode=[s.mode for s in seats],
        order=[s.reserve_order for s in seats],
        active_world_size=seats[0].active_world_size if seats else 0,
    )
    lost = [i for i in fresh if work.mode[i] is Mode.ACTIVE]
    for i in fresh:
        work.mode[i] = Mode.TERMINATED
    replaced = _take_reserves(topology, work, lost)
    unhandled = [i for i in lost if i not in replaced]
    if unhandled:
        emptied = sorted(_backfill(topology, work, unhandled))
        work.active_world_size -= len(unhandled)
        for i, number in enumerate(work.active):
            if number is not None:
                work.active[i] = number - bisect.bisect_left(emptied, number)
    next_order = max((s.reserve_order for s in seats), default=-1) + 1
    if world_size_filter is not None:
        wanted = world_size_filter(work.active_world_size)
        if (
            not isinstance(wanted, int)
            or isinstance(wanted, bool)
            or not 0 <= wanted <= work.active_world_size
        ):
            raise ValueError(
                f"world_size_filter({work.active_world_size}) returned {wanted!r}: "
                f"expected an integer from 0 to {work.active_world_size}"
            )
        work.active_world_size = wanted
        for i, number in enumerate(work.active):
            if work.mode[i] is Mode.ACTIVE and number is not None and number >= wanted:
                work.mode[i] = Mode.INACTIVE
                work.active[i] = None
                work.order[i] = next_order
                next_order += 1
    live = [i for i, m in enumerate(work.mode) if m is not Mode.TERMINATED]
    numbers = {i: n for n, i in enumerate(live)}
    return tuple(
        Seat(
            rank=numbers.get(i),
            world_size=len(live),
            active_rank=work.active[i] if i in numbers else None,
            active_world_size=work.active_world_size,
            mode=work.mode[i],
            reserve_order=work.order[i] if work.mode[i] is Mode.INACTIVE else -1,
        )
        for i in range(len(seats))
    )


# -- the exchange of entries -----------------------------------------------------------


class KeyValueStore(Protocol):
    """The part of a torch ``Store`` the tree's exchange uses."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...


def parse_entry(raw: bytes, rank: int, layers: int, world_size: int) -> Entry:
    """Rank ``rank``'s published entry; ``RestartError`` (one line) for anything else:
    anyone who reaches the store can write there."""
    limit = layers * (KEY_LIMIT + 8) + 64
    if len(raw) > limit:
        raise RestartError(f"rank {rank}'s tree entry is {len(raw)} bytes, over {limit}")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise RestartError(f"rank {rank}'s tree entry {raw[:80]!r} is not JSON") from None
    keys = data.get("keys") if isinstance(data, dict) else None
    initial = data.get("initial_rank") if isinstance(data, dict) else None
    if (
        type(initial) is not int
        or not 0 <= initial < world_size
        or not isinstance(keys, list)
        or len(keys) != layers
        or not all(isinstance(k, str) and len(k) <= KEY_LIMIT for k in keys)
    ):
        raise RestartError(
            f"rank {rank}'s tree entry {raw[:80]!r} is not "
            f'{{"initial_rank": 0..{world_size - 1}, "keys": [{layers} JSON texts]}}'
        )
    return Entry(rank, initial, tuple(keys))


def _wait_for(store: KeyValueStore, keys: list[str], timeout: float) -> None:
    """Poll until every key exists (a timed-out ``wait`` leaves a TCPStore client
    unusable), or ``RestartError`` naming the missing ones."""
    deadline = time.monotonic() + timeout
    pause = _POLL_MIN
    pending = list(keys)
    while pending:
        pending = [k for k in pending if not store.check([k])]
        if not pending:
            return
        if time.monotonic() >= deadline:
            names = ", ".join(k.rsplit("/", 1)[-1] for k in pending[:8])
            raise RestartError(
                f"ranks {names} did not publish their tree entries within {timeout:g}s"
            )
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX)


def _exchange_through_store(
    store: KeyValueStore, state: State, keys: tuple[str, ...], timeout: float, build: int
) -> list[Entry]:
    prefix = f"{STORE_PREFIX}/{build}/{state.world_size}"
    mine = json.dumps({"initial_rank": state.initial_rank, "keys": list(keys)})
    store.set(f"{prefix}/{state.rank}", mine)
    names = [f"{prefix}/{r}" for r in range(state.world_size)]
    _wait_for(store, names, timeout)
    return [
        parse_entry(store.get(name), r, len(keys), state.world_size) for r, name in enumerate(names)
    ]


def _exchange_nvidia(store: Any, state: State, keys: list[object]) -> list[Entry]:
    """Through an NVIDIA-style store (``send_state``/``get_states``/``send_key``/
    ``get_keys``), as NVIDIA's ``Tree`` uses it."""
    ranks = range(state.world_size)
    store.send_state(state, state.rank)
    states = list(store.get_states(ranks))
    store.send_key(keys, state.rank)
    peer_keys = list(store.get_keys(ranks))
    if len(states) != len(ranks) or len(peer_keys) != len(ranks):
        raise RestartError(
            f"the store gave {len(states)} states and {len(peer_keys)} keys for {len(ranks)} ranks"
        )
    out = []
    # Thousands of ranks share a handful of keys: encode each distinct one once.
    known: dict[tuple[int, type, object], str] = {}

    def text(layer: int, value: object) -> str:
        try:
            return known[(layer, type(value), value)]
        except TypeError:  # unhashable (a list): encode it every time
            return group_key(layer, value)
        except KeyError:
            known[(layer, type(value), value)] = found = group_key(layer, value)
            return found

    for r, (peer, peer_key) in enumerate(zip(states, peer_keys, strict=True)):
        initial = getattr(peer, "initial_rank", None)
        if type(initial) is not int or not isinstance(peer_key, list | tuple):
            raise RestartError(f"rank {r}'s state or keys from the store are malformed")
        if len(peer_key) != len(keys):
            raise RestartError(f"rank {r} gave {len(peer_key)} keys for {len(keys)} layers")
        out.append(Entry(r, initial, tuple(text(i, k) for i, k in enumerate(peer_key))))
    return out


def _check_entries(entries: Iterable[Entry]) -> None:
    seen: set[int] = set()
    for entry in entries:
        if entry.initial_rank in seen:
            raise RestartError(f"two ranks claim initial rank {entry.initial_rank}")
        seen.add(entry.initial_rank)


# -- the assignment --------------------------------------------------------------------


class Tree:
    """NVIDIA 0.4's ``rank_assignment.Tree``: a rank assignment and filter in one (it is
    not composed with others).

    ``layers[0]`` is the root; ``world_size_filter(n)`` may lower the active world size
    ``n`` after each assignment.  ``timeout`` (a ``timedelta`` or seconds) bounds the wait
    for the other ranks' keys at the first call (stalwart's; NVIDIA's has none).  The
    state handed back carries ``rank``/``world_size`` over every live rank, reserves
    included, and
    ``active_rank``/``active_world_size``, the numbers the function sees; the initial
    ranks the tree terminated are added to ``state.terminated``.
    """

    def __init__(
        self,
        layers: list[Layer],
        world_size_filter: Callable[[int], int] | None = None,
        timeout: timedelta | float = timedelta(minutes=5),
    ) -> None:
        if not isinstance(layers, list | tuple) or not layers:
            raise ValueError(f"layers must be a non-empty list of Layer, got {layers!r}")
        if world_size_filter is not None and not callable(world_size_filter):
            raise ValueError(
                f"world_size_filter must be callable or None, got {world_size_filter!r}"
            )
        self.layers = list(layers)
        self.world_size_filter = world_size_filter
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
            raise ValueError(f"timeout must be a positive duration, got {timeout!r}")
        self.timeout = float(seconds)
        self._topology: Topology | None = None
        self._seats: tuple[Seat, ...] = ()
        self._store: object = None
        self._builds = 0

    @property
    def init_rank_map(self) -> Mapping[int, TreeLeaf]:
        """Initial rank -> its leaf (``.state`` is its ``Seat``); empty before the first call."""
        if self._topology is None:
            return {}
        return {
            r: TreeLeaf(r, seat) for r, seat in zip(self._topology.leaves, self._seats, strict=True)
        }

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = ctx.state
        if self._topology is None or ctx.store is not self._store:
            # A new store is a new job (another wrapped call): build the tree again.
            self._build(state, ctx.store)
        assert self._topology is not None
        self._seats = reassign(
            self._topology, self._seats, set(ctx.terminated_ranks), self.world_size_filter
        )
        leaves = self._topology.leaves
        gone = frozenset(
            r for r, s in zip(leaves, self._seats, strict=True) if s.mode is Mode.TERMINATED
        )
        try:
            seat = self._seats[leaves.index(state.initial_rank)]
        except ValueError:
            raise RestartError(
                f"initial rank {state.initial_rank} is not a leaf of the tree"
            ) from None
        if seat.mode is Mode.TERMINATED or seat.rank is None:
            raise RankDiscarded(
                f"initial rank {state.initial_rank} was terminated by the tree "
                f"(terminated ranks {sorted(ctx.terminated_ranks)})"
            )
        placed = dataclasses.replace(
            state,
            rank=seat.rank,
            world_size=seat.world_size,
            active_rank=seat.active_rank,
            active_world_size=seat.active_world_size,
            mode=seat.mode,
            terminated=frozenset(state.terminated) | gone,
        )
        return RankAssignmentCtx(placed, ctx.store, set())

    def _build(self, state: State, store: object) -> None:
        rules = tuple(LayerRule.of(i, layer) for i, layer in enumerate(self.layers))
        raw = [
            layer.key_or_fn(state) if callable(layer.key_or_fn) else layer.key_or_fn
            for layer in self.layers
        ]
        keys = tuple(group_key(i, k) for i, k in enumerate(raw))
        if all(callable(getattr(store, m, None)) for m in ("send_key", "get_keys", "get_states")):
            entries = _exchange_nvidia(store, state, raw)
        elif all(callable(getattr(store, m, None)) for m in ("set", "get", "check")):
            kv: KeyValueStore = store  # type: ignore[assignment]
            # Every rank's tree builds in step with the others' (once per store), so the
            # n-th build of one rank meets the n-th of the others under the same keys.
            entries = _exchange_through_store(kv, state, keys, self.timeout, self._builds)
            self._builds += 1
        else:
            raise TypeError(f"Tree needs a torch Store in ctx.store, got {store!r}")
        _check_entries(entries)
        topology = build_topology(rules, entries)
        by_initial = {e.initial_rank: e.rank for e in entries}
        self._seats = first_seats(
            topology, [by_initial[r] for r in topology.leaves], state.world_size
        )
        self._topology = topology
        self._store = store

    def __repr__(self) -> str:
        return f"Tree({self.layers!r}, world_size_filter={self.world_size_filter!r})"
