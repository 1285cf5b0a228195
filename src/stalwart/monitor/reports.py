"""What the monitor hands to the supervisor: hang reports and workload control requests."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class HangKind(enum.Enum):
    """Which deadline a rank missed."""

    HEARTBEAT = "heartbeat"
    INITIAL_HEARTBEAT = "initial_heartbeat"
    SECTION = "section"
    OUT_OF_SECTION = "out_of_section"
    TIMER = "timer"


class ControlAction(enum.Enum):
    """What a rank asks the launcher to do with the workload."""

    CONTINUE = "continue"
    EXCLUDE_NODE = "exclude_node"
    SHUTDOWN_WORKLOAD = "shutdown_workload"


@dataclasses.dataclass(frozen=True)
class HangReport:
    """One hung rank, already asked for its stacks and sent the terminate signal.

    section: the section that timed out (SECTION), the last opened section otherwise,
        or the timer scope (TIMER).
    timeout: the deadline that was missed, in seconds.
    stacks: text the rank wrote after the stack-dump signal (empty when its stderr is not
        a file we know).
    detected_at: wall-clock time (time.time()) of detection.
    waiting_on: global rank of the node's hung rank whose progress stopped first, when
        that is another rank (this one is then most likely blocked waiting on it); None
        for the root cause itself. See `judge.blame`.
    dossier: path of the hang dossier written at detection, if any.
    """

    local_rank: int
    global_rank: int
    pid: int
    kind: HangKind
    section: str | None
    timeout: float
    last_heartbeat_age: float | None
    iteration: int | None
    stacks: str
    detected_at: float
    waiting_on: int | None = None
    dossier: str | None = None
    evidence: str | None = None  # what made it a hang and its part in it (monitor.evidence)

    def to_event(self) -> dict[str, Any]:
        """JSON-safe form for events.jsonl (stacks left out: they go to the log)."""
        return {
            "local_rank": self.local_rank,
            "global_rank": self.global_rank,
            "pid": self.pid,
            "kind": self.kind.value,
            "section": self.section,
            "timeout": self.timeout,
            "last_heartbeat_age": self.last_heartbeat_age,
            "iteration": self.iteration,
            "detected_at": self.detected_at,
            "waiting_on": self.waiting_on,
            "dossier": self.dossier,
            "evidence": self.evidence,
        }


@dataclasses.dataclass(frozen=True)
class ControlRequest:
    """A rank's request about the workload; `local_rank` is None for an unknown pid.

    reason: set when the monitor itself asks on a rank's behalf (``straggler_restart``):
    why, in one line; empty for a request the rank sent."""

    action: ControlAction
    global_rank: int | None
    local_rank: int | None
    pid: int
    received_at: float
    reason: str = ""
