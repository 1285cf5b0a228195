"""A DCP ``AsyncStager`` that copies into buffers it keeps from one save to the next.

DCP's own blocking staging allocates a fresh CPU copy of the state on every save
(memory churn users report as leaks, and the copy stalls the loop); its
asynchronous stager copies on a thread but still allocates. This one allocates
each buffer once (by the tensor's place in the state dict, its shape and dtype)
and copies on one background thread, so ``dcp.async_save`` returns as soon as
the copy is queued. A DTensor is staged as a DTensor over the staged local
shard, with its mesh, placements and global shape, so DCP plans it as usual.

The buffers are reused: the next ``stage`` waits for the copy before it and for
the uploads passed to :meth:`ReusingStager.hold_until`
(:class:`stalwart.checkpoint.dcp.AsyncDcpSaver` does that); a caller of
``dcp.async_save`` directly waits for the previous upload before the next save.

Given an *arena* (the writer subprocess's shared buffer, ``ShardProcess``), the
buffers of CPU tensors are views of that shared memory: the writer then reads the
staged tensors where they are, and the rank copies each tensor once, not twice.
The region is taken only once the writer stopped reading it for the previous save.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from .staging import PAGE_ALIGN, PAGE_ALIGN_FROM, TENSOR_ALIGN

_Key = tuple[str, ...]


class StagingArena(Protocol):
    """Shared memory a stager may fill in place (``ShardProcess`` is one)."""

    def lend(self, nbytes: int) -> torch.Tensor: ...


def arena_layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of tensors of ``sizes`` bytes packed into an arena, and its length: each
    starts ``TENSOR_ALIGN``-aligned, large ones on a page, as the writer's own staging."""
    offsets: list[int] = []
    end = 0
    for n in sizes:
        if n < 0:
            raise ValueError(f"tensor of {n} bytes: expected >= 0")
        align = PAGE_ALIGN if n >= PAGE_ALIGN_FROM else TENSOR_ALIGN
        end = (end + align - 1) // align * align
        offsets.append(end)
        end += n
    return offsets, end


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _leaves(obj: Any, key: _Key) -> Iterator[tuple[_Key, torch.Tensor]]:
    """The tensors ``ReusingStager._mirror`` stages, by the same keys."""
    if isinstance(obj, DTensor):
        yield key, obj.to_local()
    elif isinstance(obj, torch.Tensor):
        yield key, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*key, str(k)))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*key, str(i)))


class ReusingStager(AsyncStager):
    """Stage a state dict into reused CPU buffers, in the background by default."""

    _synchronize_after_execute = False

    def __init__(self, *, background: bool = True, arena: StagingArena | None = None) -> None:
        self._buffers: dict[_Key, torch.Tensor] = {}
        self._arena = arena
        # The arena region the buffers view now, and the layout they were cut for.
        self._region: tuple[int, int] | None = None
        self._layout: list[tuple[_Key, tuple[int, ...], torch.dtype]] = []
        self._lock = threading.Lock()
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="stalwart-dcp-stage") if background else None
        )
        self._pending: Future[Any] | None = None
        self._held: list[Future[Any]] = []
        #: The bytes the latest ``stage`` copies, once its walk is done (a future: the
        #: walk runs in the background).
        self.staged_bytes: Future[int] = Future()
        self.staged_bytes.set_result(0)

    def hold_until(self, upload: Future[Any]) -> None:
        """The next staging waits for ``upload`` (it reads this stager's buffers)."""
        with self._lock:
            self._held.append(upload)

    def _wait_idle(self) -> None:
        with self._lock:
            waits = [*self._held, *([self._pending] if self._pending else [])]
            self._held = []
        for fut in waits:
            # A failed earlier save is reported by its own future, not by this one.
            fut.exception()

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]] | dict[str, Any]:
        self._wait_idle()
        sized: Future[int] = Future()
        self.staged_bytes = sized

        # All of it off the caller's thread, the walk over the state dict included (it
        # was most of the loop's stall: a few microseconds per tensor, hundreds of
        # tensors with AdamW): taking the arena may wait for the writer (and grow it,
        # the first time); DCP's contract keeps the state unchanged until staging
        # completes. Without autograd, ``to_local`` is an attribute read, not an
        # autograd Function call (grad mode is per thread: set here, not inherited).
        def run() -> dict[str, Any]:
            with torch.no_grad():
                leaves = list(_leaves(state_dict, ()))
                sized.set_result(sum(_nbytes(t) for _, t in leaves))
                if self._arena is not None:
                    self._place(self._arena, leaves)
                copies: list[tuple[torch.Tensor, torch.Tensor]] = []
                staged = self._mirror(state_dict, (), copies)
                for dst, src in copies:
                    dst.copy_(src)
            return staged  # type: ignore[no-any-return]

        if self._pool is None:
            return run()
        fut = self._pool.submit(run)
        with self._lock:
            self._pending = fut
        return fut

    def synchronize_staging(self) -> None:
        with self._lock:
            pending = self._pending
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self._wait_idle()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._buffers.clear()
        self._region, self._layout = None, []

    def _place(self, arena: StagingArena, leaves: list[tuple[_Key, torch.Tensor]]) -> None:
        # CUDA tensors keep pinned buffers of their own: the device copy needs them.
        host = [(k, t) for k, t in leaves if not t.is_cuda and _nbytes(t) > 0]
        layout = [(k, tuple(t.shape), t.dtype) for k, t in host]
        offsets, total = arena_layout([_nbytes(t) for _, t in host])
        region = arena.lend(total)
        at = (region.data_ptr(), region.numel())
        if at == self._region and layout == self._layout:
            return  # the same views as last time
        before = {k for k, _, _ in self._layout}
        self._buffers = {k: b for k, b in self._buffers.items() if k not in before}
        for (k, t), off in zip(host, offsets, strict=True):
            self._buffers[k] = region[off : off + _nbytes(t)].view(t.dtype).view(t.shape)
        self._region, self._layout = at, layout

    def _buffer(self, key: _Key, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(
                src.shape, dtype=src.dtype, pin_memory=src.is_cuda and torch.cuda.is_available()
            )
            self._buffers[key] = buf
        return buf

    def _mirror(self, obj: Any, key: _Key, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        if isinstance(obj, DTensor):
            local = obj.to_local().detach()
            buf = self._buffer(key, local)
            copies.append((buf, local))
            # Not DTensor.from_local: on a CUDA mesh it moves a CPU local tensor back to
            # the GPU, copying the buffer *now*, before the background copy fills it, so
            # the save held stale bytes (seen on an H100: every restored tensor differed)
            # and the state took GPU memory twice. torch's own CPU staging keeps the
            # spec and swaps the local tensor the same way.
            return DTensor(buf, obj._spec, requires_grad=False)  # type: ignore[no-untyped-call]
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            buf = self._buffer(key, src)
            copies.append((buf, src))
            return buf
        recurse: Callable[[Any, str], Any] = lambda v, k: self._mirror(v, (*key, k), copies)  # noqa: E731
        if isinstance(obj, dict):
            return {k: recurse(v, str(k)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [recurse(v, str(i)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(recurse(v, str(i)) for i, v in enumerate(obj))
        # Plain values (step counters, a data loader's position) are small; a copy keeps
        # the loop's later changes out of this save.
        return copy.deepcopy(obj)
