"""One node's launcher and supervisor (``stalwart run``).

Light at import: worker bootstraps import this package, so the heavy parts (the
supervisor pulls in torch through the rendezvous) load only when used.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ProcessContext",
    "ProcessFailure",
    "RunResult",
    "Std",
    "Supervisor",
    "record",
    "start_processes",
]


def __getattr__(name: str) -> Any:
    if name in ("ProcessContext", "RunResult", "start_processes"):
        from stalwart.launch.workers import processes as workers

        return getattr(workers, name)
    if name == "record":
        from stalwart.launch.workers.errors import record

        return record
    if name == "ProcessFailure":
        # The launcher's one failure record (``RunResult.failures`` holds them), under
        # the name torchrun's API gives it.
        from stalwart.rendezvous.api import WorkerFailed

        return WorkerFailed
    if name == "Std":
        from stalwart.launch.files.logs import Std

        return Std
    if name == "Supervisor":
        from stalwart.launch.round.supervisor import Supervisor

        return Supervisor
    raise AttributeError(name)
