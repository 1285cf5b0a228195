"""Health checks in NVIDIA ``inprocess``'s shape: ``check(state, exception)``.

The wrapper runs the health check before each iteration (``exception`` is
``None``) and after a fault (the exception this rank saw, or ``None`` when a
peer's fault interrupted it).  A check reports an unhealthy rank by raising;
the wrapper turns that into ``HealthCheckError`` and the rank leaves the job.
Checks return ``(state, exception)`` so they chain with ``Compose``.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Protocol

import torch

from stalwart.base import envvars

from .errors import BarrierTimeout, RestartError
from .state import State

log = logging.getLogger(__name__)


class HealthCheck(Protocol):
    def __call__(
        self, state: State, train_ex: BaseException | None = None
    ) -> tuple[State, BaseException | None]: ...


class CudaHealthCheck:
    """Synchronize with this rank's GPU; a hung or failed sync makes the rank unhealthy.

    The device is ``LOCAL_RANK``'s (else the current one).  Without CUDA, or
    before CUDA was initialized in this process, there is nothing to check.
    """

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=30)) -> None:
        self.timeout = timeout

    def __call__(
        self, state: State, train_ex: BaseException | None = None
    ) -> tuple[State, BaseException | None]:
        initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        if not (torch.cuda.is_available() and initialized):
            return state, train_ex
        local_rank = os.environ.get(envvars.LOCAL_RANK)
        device = torch.device(
            "cuda", int(local_rank) if local_rank is not None else torch.cuda.current_device()
        )
        # A sync can wait forever on a kernel that never ends: bound it from outside.
        sync = threading.Thread(
            target=torch.cuda.synchronize, args=(device,), name="CudaHealthCheckSync", daemon=True
        )
        sync.start()
        sync.join(self.timeout.total_seconds())
        if sync.is_alive():
            raise BarrierTimeout(
                f"torch.cuda.synchronize({device}) did not return in "
                f"{self.timeout.total_seconds():g}s"
            )
        # The first sync may only drain queued work; the second shows a broken context.
        torch.cuda.synchronize(device)
        return state, train_ex


class FaultCounterExceeded(RestartError):
    """This rank caused more faults than ``FaultCounter`` allows."""


class FaultCounter:
    """Take this rank out of the job once it has faulted more than ``max_rank_faults`` times.

    Only faults this rank saw count (``exception`` not ``None``), so survivors of
    another rank's fault are not charged.
    """

    def __init__(self, max_rank_faults: int | None = None) -> None:
        self.max_rank_faults = max_rank_faults
        self.faults_count = 0

    def __call__(
        self, state: State, train_ex: BaseException | None = None
    ) -> tuple[State, BaseException | None]:
        if train_ex is None:
            return state, train_ex
        self.faults_count += 1
        if self.max_rank_faults is not None and self.faults_count > self.max_rank_faults:
            raise FaultCounterExceeded(
                f"rank {state.initial_rank} faulted {self.faults_count} times "
                f"(max_rank_faults={self.max_rank_faults})"
            )
        return state, train_ex
