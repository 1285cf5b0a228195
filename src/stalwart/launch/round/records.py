"""The records a node's supervisor hands between its parts and back to its caller:
`SignalReceived` (a termination signal, raised where the main thread is) and `JobResult`
(how the job ended on this node).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.launch.round.decide import State
from stalwart.rendezvous import WorkerFailed


class SignalReceived(BaseException):
    """A termination signal reached the launcher; the job must stop now.

    A BaseException, as KeyboardInterrupt is: the handler raises it wherever the main
    thread happens to be, and an ``except Exception`` there (logging's ``emit``, a sink
    that must not stop hang detection) would otherwise swallow the signal and leave the
    job running (seen once under load: a SIGINT the launcher never acted on).
    """

    def __init__(self, sig: int) -> None:
        super().__init__(f"launcher received {signal.Signals(sig).name}")
        self.sig = sig


@dataclass(frozen=True)
class JobResult:
    """How the job ended on this node; made from a ``Stop`` in one place
    (``Supervisor._result``)."""

    exit_code: int
    state: State
    attempts: int
    failures: list[WorkerFailed]
    return_values: dict[int, Any]
    run_dir: Path | None
