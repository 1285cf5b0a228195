"""The default ``abort``: make blocked communication return and drop process groups.

``abort`` runs on the rank that faulted (main thread) and on every survivor
(monitor thread, while the main thread may be blocked in a collective), so it
must be safe to call from any thread and more than once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .sockets import release_iteration_sockets
from .state import State

log = logging.getLogger(__name__)


class Abort(Protocol):
    """Asynchronously stops this rank's communication for the current iteration."""

    def __call__(self, state: State) -> State | None: ...


def _nccl_backend(group: Any) -> Any | None:
    """The group's NCCL backend, or ``None`` for a group without one (gloo, or no CUDA)."""
    try:
        backend = group._get_backend(torch.device("cuda"))
    except Exception:  # no backend registered for CUDA devices
        return None
    try:
        return backend if backend.name() == "nccl" else None
    except Exception:
        return None


def abort_nccl_communicators(
    groups: Iterable[Any] | None = None,
    cuda_available: Callable[[], bool] | None = None,
) -> list[Any]:
    """Abort the NCCL communicators of every live process group; returns the groups aborted.

    A rank blocked in an NCCL collective returns only when its communicator is
    aborted: closing sockets does not reach it.  Uses torch's own
    ``ProcessGroup.abort()``, with the aborts batched between the NCCL
    backend's group start and end as torch's ``_abort_process_group`` does (so
    aborting one communicator cannot wait on another).  Does nothing without
    CUDA, so gloo jobs are untouched.
    """
    if not (cuda_available or torch.cuda.is_available)() or not dist.is_available():
        return []
    if groups is None:
        groups = _live_groups()
    nccl = [(g, b) for g in groups if (b := _nccl_backend(g)) is not None]
    if not nccl:
        return []
    batch = nccl[0][1]
    batched = hasattr(batch, "_group_start") and hasattr(batch, "_group_end")
    if batched:
        batch._group_start()
    try:
        # Newest first: subgroups go before the default group they were split from.
        for group, _ in reversed(nccl):
            try:
                group.abort()
            except Exception as exc:  # one broken communicator must not keep the others
                log.warning("NCCL abort of group %r failed: %s", group, exc)
    finally:
        if batched:
            batch._group_end()
    return [g for g, _ in nccl]


def _live_groups() -> list[Any]:
    world = getattr(dist.distributed_c10d, "_world", None)
    for _ in range(3):
        try:
            return list(getattr(world, "pg_names", {}) or {})
        except RuntimeError:  # resized by the main thread while copying
            continue
    return []


def destroy_process_groups() -> None:
    """Destroy every torch.distributed process group, ignoring a half-torn state."""
    if not dist.is_available():
        return
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a group already broken by the abort is expected here
            log.debug("destroy_process_group: %s", exc)
    _reset_group_counter()


def _reset_group_counter() -> None:
    """Undo what an interrupted ``init_process_group`` left behind.

    It bumps the counter that names groups before it rendezvouses; if it fails
    there, this rank would name the next iteration's default group "1" while
    its peers say "0", and the next rendezvous would never meet.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is None or getattr(world, "pg_map", None):
        return
    try:
        world.group_count = 0
    except Exception as exc:
        log.debug("could not reset the process group counter: %s", exc)


class AbortTorchDistributed:
    """Abort NCCL communicators, shut down the iteration's TCP connections, destroy groups.

    The NCCL abort frees a rank blocked in an NCCL collective (a no-op without
    CUDA).  The socket shutdown is what frees gloo collectives blocked on this
    rank and, through the closed connection, on its peers; destroying the groups
    then lets the next iteration call ``init_process_group`` again.
    """

    def __init__(
        self, release_sockets: bool = True, destroy: bool = True, abort_nccl: bool = True
    ) -> None:
        self.release_sockets = release_sockets
        self.destroy = destroy
        self.abort_nccl = abort_nccl

    def __call__(self, state: State) -> State:
        if self.abort_nccl:
            abort_nccl_communicators()
        if self.release_sockets:
            release_iteration_sockets(state.protected_fds, state.protected_ports)
        if self.destroy:
            destroy_process_groups()
        return state

    def __repr__(self) -> str:
        return (
            f"AbortTorchDistributed(release_sockets={self.release_sockets}, "
            f"destroy={self.destroy}, abort_nccl={self.abort_nccl})"
        )
