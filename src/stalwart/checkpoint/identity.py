"""Which rank this process is and how many there are, when the caller did not say.

Order of precedence: an explicit argument, then the ``RANK`` / ``WORLD_SIZE``
environment variables that stalwart and torchrun set, then an initialised
``torch.distributed`` process group, then a single-process job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from stalwart.base import envvars


@dataclass
class RankInfo:
    """This process's place in the job, as torch's experimental checkpoint process
    hands it to a writer's ``__init__`` (same field names, so writers read either)."""

    global_rank: int
    global_world_size: int


def current_rank_info() -> RankInfo:
    return RankInfo(resolve_rank(None), resolve_world_size(None))


def _from_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _dist() -> tuple[int, int] | None:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _resolve(given: int | None, env_name: str, field: int, alone: int) -> int:
    """`given`, else the environment variable, else field `field` of the process
    group's (rank, world size), else `alone` (a single-process job)."""
    if given is not None:
        return given
    env = _from_env(env_name)
    if env is not None:
        return env
    d = _dist()
    return d[field] if d else alone


def resolve_rank(rank: int | None) -> int:
    return _resolve(rank, envvars.RANK, 0, 0)


def resolve_world_size(world_size: int | None) -> int:
    return _resolve(world_size, envvars.WORLD_SIZE, 1, 1)
