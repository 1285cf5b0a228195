"""What every framework callback does, apart from the framework."""

from __future__ import annotations

import logging
import os

from stalwart import progress, runlog
from stalwart.monitor import RankMonitorClient, envvars

logger = logging.getLogger(__name__)


class Reporter:
    """Heartbeats, steps and checkpoint saves of one worker.

    Under ``stalwart run`` each ``step`` is a heartbeat, an iteration for the hang
    report and a progress sample for the accounting, all plain stores into shared
    memory.  Elsewhere (plain torchrun, a notebook) it only costs the calls: no monitor
    is looked for, so nothing warns.
    """

    def __init__(self) -> None:
        self._client: RankMonitorClient | None = None

    def start(self) -> None:
        if self._client is None and os.environ.get(envvars.SHM_FILE):
            client = RankMonitorClient()
            client.init_workload_monitoring()
            self._client = client

    def step(self, step: int) -> None:
        progress.report(step)
        client = self._client
        if client is not None:
            client.send_heartbeat()
            client.report_iteration(step)

    def checkpoint_saved(self, step: int, path: str | None = None) -> None:
        runlog.emit(runlog.CHECKPOINT_COMMIT, step=step, path=path, source_framework=True)

    def stop(self) -> None:
        if self._client is not None:
            self._client.shutdown_workload_monitoring()
            self._client = None
