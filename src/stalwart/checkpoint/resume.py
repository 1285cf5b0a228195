"""One resume step for the whole job: the newest step every rank can load, RAM or disk.

Each rank lists the steps it could load: its snapshots in the launcher's memory (see
``ram``) and the complete steps on disk. The ranks exchange the lists (through the
process group when one is initialised, else through the job's store at
``MASTER_ADDR:MASTER_PORT``), take the newest step in all of them (``choose_step``), and
each loads it, from RAM when it has it there. If any rank fails to verify that step,
every rank learns so, the failing rank drops it, and they agree again: so a torn or
corrupt newest file on one rank makes all ranks resume from the previous step.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Protocol

import msgspec
import torch

from stalwart.base import envvars
from stalwart.base.pgdevice import group_device

from .errors import CheckpointError
from .identity import resolve_rank, resolve_world_size
from .inplace import StateMismatchError, bind, copy_pairs
from .loader import Loaded, complete_steps, load_step
from .ram import RamSegment, RamSnapshot, find_snapshots, ram_folder
from .ramlayout import FETCHING_MARKER

logger = logging.getLogger(__name__)

#: Prefix of the store keys the ranks exchange their candidate steps under.
STORE_PREFIX = "stalwart/ckpt/restore"
#: Candidate steps each rank offers per round (newest first).
MAX_CANDIDATES = 64
#: Largest store value a rank decodes from a peer: MAX_CANDIDATES int64 steps in JSON
#: take at most 64 x 20 bytes; anyone who reaches the store can write the key, so a
#: larger value is not a peer's.
MAX_EXCHANGE_BYTES = 2048
# What a peer's value must decode to: its steps (or its one verdict), each an int64 >= 0.
# A typed decode stops at the first element that is not a number, however deep the
# nesting a forged value holds.
_Row = Annotated[
    list[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]],
    msgspec.Meta(max_length=MAX_CANDIDATES),
]
_ROW_DECODER = msgspec.json.Decoder(_Row)
# The launcher's fetch is bounded by its own socket timeouts; this only stops a restore
# from waiting on a launcher that died mid-fetch.
_FETCH_WAIT_S = 120.0
_FETCH_POLL_S = 0.01
_calls = itertools.count()


def choose_step(per_rank: Sequence[Sequence[int]]) -> int | None:
    """The newest step every rank offers, or None when they share none."""
    if not per_rank:
        return None
    common = set(per_rank[0]).intersection(*per_rank[1:])
    return max(common) if common else None


class Exchange(Protocol):
    def all_gather(self, values: list[int]) -> list[list[int]]: ...


class _Alone:
    def all_gather(self, values: list[int]) -> list[list[int]]:
        return [list(values)]


class _GroupExchange:
    """Through an initialised process group: fixed-width int64 tensors, no pickling."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._device = group_device(group)
        self._size = dist.get_world_size(group)

    def all_gather(self, values: list[int]) -> list[list[int]]:
        width = MAX_CANDIDATES + 1
        mine = torch.full((width,), -1, dtype=torch.int64)
        mine[0] = len(values)
        mine[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
        mine = mine.to(self._device)
        out = [torch.empty_like(mine) for _ in range(self._size)]
        self._dist.all_gather(out, mine, group=self._group)
        rows = [t.cpu().tolist() for t in out]
        return [row[1 : 1 + int(row[0])] for row in rows]


class _StoreExchange:
    """Through the job's key-value store; keys are unique per restart, call and round."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float) -> None:
        self._store = store
        self._rank = rank
        self._world = world_size
        self._timeout = timedelta(seconds=timeout_s)
        restart = os.environ.get(envvars.RESTART_COUNT, "0")
        self._base = f"{STORE_PREFIX}/{restart}/{next(_calls)}"
        self._round = itertools.count()

    def all_gather(self, values: list[int]) -> list[list[int]]:
        prefix = f"{self._base}/{next(self._round)}"
        self._store.set(f"{prefix}/{self._rank}", msgspec.json.encode(values))
        keys = [f"{prefix}/{r}" for r in range(self._world)]
        self._store.wait(keys, self._timeout)
        return [decode_row(key, self._store.get(key)) for key in keys]


def decode_row(key: str, raw: bytes) -> list[int]:
    """A peer's value at store key `key`: a JSON list of at most MAX_CANDIDATES steps,
    else CheckpointError in one line naming the key and what was expected."""
    if len(raw) > MAX_EXCHANGE_BYTES:
        raise CheckpointError(
            f"store key {key}: value of {len(raw)} bytes is over the limit of "
            f"{MAX_EXCHANGE_BYTES}; expected a JSON list of at most {MAX_CANDIDATES} steps"
        )
    try:
        return _ROW_DECODER.decode(raw)
    except msgspec.DecodeError as err:
        raise CheckpointError(
            f"store key {key}: expected a JSON list of at most {MAX_CANDIDATES} steps "
            f"(int64 >= 0), got {len(raw)} bytes that are not ({err})"
        ) from None


def _job_store(timeout_s: float) -> Any:
    addr = os.environ.get(envvars.MASTER_ADDR)
    port = os.environ.get(envvars.MASTER_PORT)
    if not addr or not port:
        return None
    from torch._C._distributed_c10d import TCPStore

    return TCPStore(
        addr,
        int(port),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _exchange_for(rank: int, world_size: int, group: Any, store: Any, timeout_s: float) -> Exchange:
    if world_size == 1:
        return _Alone()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return _GroupExchange(group)
    if store is None:
        store = _job_store(timeout_s)
    if store is None:
        raise CheckpointError(
            f"restore with world size {world_size} needs an initialised process group or "
            "the job's store (MASTER_ADDR and MASTER_PORT are unset)"
        )
    return _StoreExchange(store, rank, world_size, timeout_s)


def _to_location(obj: Any, where: Any, keep: frozenset[int] = frozenset()) -> Any:
    """``obj`` with its tensors moved to ``where``, except the caller's own (``keep``)."""
    if where is None or str(where) == "cpu":
        return obj
    if isinstance(obj, torch.Tensor):
        return obj if id(obj) in keep else obj.to(where)
    if isinstance(obj, dict):
        return type(obj)((k, _to_location(v, where, keep)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return type(obj)(_to_location(v, where, keep) for v in obj)
    return obj


def wait_for_fetch(folder: Path, rank: int, timeout_s: float = _FETCH_WAIT_S) -> None:
    """The launcher may still be copying this node's snapshots in from peers (it starts
    the workers meanwhile, so their start-up overlaps the copy): wait until it is done."""
    marker = folder / FETCHING_MARKER
    if not marker.exists():
        return
    logger.info("rank %d: waiting for the launcher to fetch snapshots from peers", rank)
    t0 = time.monotonic()
    while marker.exists():
        if time.monotonic() - t0 > timeout_s:
            logger.warning(
                "rank %d: the launcher's fetch from peers took over %.0f s; restoring without it",
                rank,
                timeout_s,
            )
            return
        time.sleep(_FETCH_POLL_S)
    logger.info("rank %d: fetched after %.3f s", rank, time.monotonic() - t0)


def _default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


# What a rank tells the others after trying the agreed step.
_LOADED, _CANNOT, _MISMATCH = 1, 0, 2


class _Segments:
    """The snapshot segments one restore reads, each mapped once (or the caller's own)."""

    def __init__(self, own: RamSegment | None) -> None:
        self._own = own
        self._open: dict[Path, RamSegment] = {}

    def get(self, path: Path) -> RamSegment:
        if self._own is not None and path == self._own.path:
            # Not waiting for its background pre-faulting: that covers both slots, and
            # reading one populates its own pages (RamSegment.verify).
            return self._own
        seg = self._open.get(path)
        if seg is None:
            seg = self._open[path] = RamSegment.open(path, writable=False)
        return seg

    def close(self) -> None:
        for seg in self._open.values():
            seg.close()
        self._open.clear()


def restore(
    directory: str | os.PathLike[str],
    rank: int | None = None,
    world_size: int | None = None,
    *,
    group: Any = None,
    store: Any = None,
    map_location: Any = "cpu",
    weights_only: bool = True,
    timeout_s: float = 300.0,
    threads: int | None = None,
    into: Any = None,
    segment: RamSegment | None = None,
) -> Loaded | None:
    """Load the newest step every rank can verify, from RAM where it is there, else disk.

    Every rank must call it (it is collective). Returns None on every rank when the
    ranks share no loadable step. ``map_location`` may be ``"cpu"``, a device or its
    name for snapshots from RAM (which are rebuilt on the CPU first); on disk it is
    ``torch.load``'s. ``store``: a ``torch.distributed.Store`` to exchange through when
    no process group is initialised (default: a client of ``MASTER_ADDR:MASTER_PORT``).

    ``into``: a state dict (e.g. ``{"model": model.state_dict(), "optim":
    opt.state_dict()}``) whose tensors receive the checkpoint's in place, matched by
    key; the returned state holds those tensors at those keys (so ``load_state_dict``
    with it copies nothing more), fresh tensors where ``into`` has none, and the
    checkpoint's other values. ``map_location`` applies to the fresh ones only. A tensor
    of another shape or dtype than the checkpoint's raises ``StateMismatchError`` (one
    line naming the key) on every rank, before anything is copied on that rank. None
    returned: ``into`` is unchanged. ``segment``: an already mapped segment to read
    snapshots of its path from (the checkpointer's own).
    """
    root = Path(directory)
    rank = resolve_rank(rank)
    world_size = resolve_world_size(world_size)
    threads = threads or _default_threads()
    folder, _ = ram_folder()
    if folder is not None:
        wait_for_fetch(folder, rank, min(timeout_s, _FETCH_WAIT_S))
    in_ram: list[RamSnapshot] = find_snapshots(folder, rank, world_size) if folder else []
    segments = _Segments(segment)
    try:
        # The newest snapshot in RAM is the likely answer: verify it now, once, so only a
        # step this rank can load is offered; it is copied out once the ranks agree.
        verified: RamSnapshot | None = None
        while in_ram:
            snap = in_ram[0]
            try:
                segments.get(snap.path).verify(snap.slot, snap.record)
            except (OSError, CheckpointError) as exc:
                logger.warning("skipping step %d in RAM (%s): %s", snap.step, snap.path, exc)
                in_ram.pop(0)
                continue
            verified = snap
            break
        try:
            on_disk = complete_steps(root, world_size)
        except OSError as exc:
            logger.warning("cannot list checkpoints in %s: %s", root, exc)
            on_disk = []
        candidates = {s.step for s in in_ram} | set(on_disk)
        exchange = _exchange_for(rank, world_size, group, store, timeout_s)
        dropped: set[int] = set()
        for _ in range(2 * MAX_CANDIDATES + 2):
            mine = sorted(candidates - dropped, reverse=True)[:MAX_CANDIDATES]
            agreed = choose_step(exchange.all_gather(mine))
            if agreed is None:
                logger.info("rank %d: no checkpoint step is loadable on every rank", rank)
                return None
            mismatch: StateMismatchError | None = None
            try:
                found = _load_agreed(
                    root,
                    agreed,
                    rank,
                    in_ram,
                    verified,
                    segments,
                    weights_only,
                    map_location,
                    threads,
                    into,
                )
            except StateMismatchError as exc:
                found, mismatch = None, exc
            status = _MISMATCH if mismatch else _CANNOT if found is None else _LOADED
            verdicts = exchange.all_gather([status])
            if any(v == [_MISMATCH] for v in verdicts):
                # The caller's state does not fit the checkpoint: no step will; every
                # rank raises rather than leave the others waiting.
                if mismatch is not None:
                    raise mismatch
                bad = [r for r, v in enumerate(verdicts) if v == [_MISMATCH]]
                raise StateMismatchError(
                    f"cannot restore step {agreed} in place: the state given on rank(s) "
                    f"{bad} does not fit the checkpoint (see their log)"
                )
            if all(v == [_LOADED] for v in verdicts):
                assert found is not None
                logger.info(
                    "rank %d resumes from step %d (%s, %s)", rank, agreed, found.source, found.path
                )
                return found
            # Some rank cannot load it, so it can never be agreed: every rank drops it.
            logger.info("step %d is not loadable on every rank; agreeing again", agreed)
            dropped.add(agreed)
    finally:
        segments.close()
    raise CheckpointError(f"rank {rank}: the ranks did not agree on a resume step")


def _load_agreed(
    root: Path,
    step: int,
    rank: int,
    in_ram: list[RamSnapshot],
    verified: RamSnapshot | None,
    segments: _Segments,
    weights_only: bool,
    map_location: Any,
    threads: int,
    into: Any,
) -> Loaded | None:
    for snap in in_ram:
        if snap.step != step:
            continue
        try:
            state = segments.get(snap.path).read(
                snap.slot,
                snap.record,
                weights_only=weights_only,
                threads=threads,
                into=into,
                verified=snap is verified,
            )
        except (OSError, CheckpointError) as exc:
            logger.warning("skipping step %d in RAM (%s): %s", step, snap.path, exc)
            continue
        keep = frozenset(id(t) for t in _tensors(into)) if into is not None else frozenset()
        return Loaded(step, _to_location(state, map_location, keep), snap.path, source="ram")
    try:
        found = load_step(root, step, rank, map_location=map_location, weights_only=weights_only)
    except Exception as exc:
        # Any failure (also a class weights_only refuses) must reach the other ranks,
        # which wait for this rank's verdict, rather than end this one alone.
        logger.warning("rank %d cannot load step %d from disk: %s", rank, step, exc)
        return None
    if into is None:
        return found
    state, pairs = bind(found.state_dict, into)
    copy_pairs(pairs, threads)
    return Loaded(found.step, state, found.path, found.source)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []
