"""The default ``abort``: make blocked communication return and drop process groups.

``abort`` runs on the rank that faulted (main thread) and on every survivor
(monitor thread, while the main thread may be blocked in a collective), so it
must be safe to call from any thread and more than once.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch.distributed as dist

from .sockets import release_iteration_sockets
from .state import State

log = logging.getLogger(__name__)


class Abort(Protocol):
    """Asynchronously stops this rank's communication for the current iteration."""

    def __call__(self, state: State) -> None: ...


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
    """Shut down the iteration's TCP connections, then destroy process groups.

    The socket shutdown is what frees gloo collectives blocked on this rank and,
    through the closed connection, on its peers; destroying the groups then lets
    the next iteration call ``init_process_group`` again.
    """

    def __init__(self, release_sockets: bool = True, destroy: bool = True) -> None:
        self.release_sockets = release_sockets
        self.destroy = destroy

    def __call__(self, state: State) -> None:
        if self.release_sockets:
            release_iteration_sockets(state.protected_fds, state.protected_ports)
        if self.destroy:
            destroy_process_groups()

    def __repr__(self) -> str:
        return (
            f"AbortTorchDistributed(release_sockets={self.release_sockets}, destroy={self.destroy})"
        )
