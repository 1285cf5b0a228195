"""Stragglers: ranks measurably slower per step than the others.

`StragglerWatch` owns the straggler windows: every ``straggler_window`` it measures each
rank's seconds per step (`measure`, over the pure `step_times`); alone on its node the
coordinator has it compare them here (`judge_alone`), in a job of several nodes the
job-sync part compares them with the job's and hands the verdicts back (`report`). A
straggler is named (an event each window, a console line at most every
STRAGGLER_LOG_EVERY) and, with ``straggler_restart``, its node asks to leave the job.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

from stalwart.base.events import Event
from stalwart.monitor.config import MonitorConfig
from stalwart.monitor.jobsync import JobPeers, NodeRhythm
from stalwart.monitor.judge import stragglers
from stalwart.monitor.node_state import LogEvent, Rank, Window
from stalwart.monitor.reports import ControlAction, ControlRequest

log = logging.getLogger(__name__)

STRAGGLER_LOG_EVERY = 60.0


def step_times(
    progress: Sequence[tuple[float, int]], now: float, window: float
) -> tuple[float | None, list[tuple[float, int]]]:
    """Seconds per step over the window ending `now` from (time, iteration) points, or
    None where the rank did not move in it; and the points the next window starts from
    (the window's last one)."""
    recent = [p for p in progress if p[0] >= now - window]
    if len(recent) >= 2 and recent[-1][1] > recent[0][1]:
        per_step = (recent[-1][0] - recent[0][0]) / (recent[-1][1] - recent[0][1])
        return per_step, recent[-1:]
    return None, recent[-1:]


class StragglerWatch:
    """Straggler windows of a node monitor, and what it does about a straggler."""

    def __init__(
        self,
        config: MonitorConfig,
        emit: LogEvent,
        ask: Callable[[ControlRequest], None],
        pid_of: Callable[[int], int],
        host: str | None = None,
    ) -> None:
        """ask: queues a request for the supervisor; pid_of: a local rank's worker pid
        (0: none); host: this node's name in windows (default: the host name)."""
        self.config = config
        self._emit = emit
        self._ask = ask
        self._pid_of = pid_of
        self._host = host
        self._lock = threading.Lock()
        self._due = 0.0
        self._logged: dict[int, float] = {}  # global rank -> last console line
        self._exclusion_asked = False  # --straggler-restart: once per attempt

    def new_attempt(self) -> None:
        with self._lock:
            self._exclusion_asked = False

    def measure(self, ranks: list[Rank], attempt: int | None, now: float) -> Window | None:
        """The window just ended, once every straggler_window (else None); each rank's
        progress points are trimmed to start the next one."""
        window = self.config.straggler_window
        if self._due == 0.0:
            self._due = now + window
        if now < self._due:
            return None
        self._due = now + window
        times: dict[int, float] = {}
        local: dict[int, int] = {}
        for rank in ranks:
            per_step, rank.progress = step_times(rank.progress, now, window)
            if per_step is not None:
                times[rank.global_rank] = per_step
                local[rank.global_rank] = rank.local_rank
        host = self._host if self._host is not None else socket.gethostname()
        return Window(NodeRhythm(host, window, times), local, attempt)

    def judge_alone(self, mine: Window) -> None:
        """Compares the node's ranks with each other (a job of one node)."""
        times = mine.rhythm.step_times
        self.report(
            stragglers(times, self.config.straggler_factor),
            times,
            dict.fromkeys(times, mine.rhythm.host),
            mine,
            None,
        )

    def report(
        self,
        verdicts: dict[int, float],
        step_times: dict[int, float],
        hosts: dict[int, str],
        mine: Window,
        peers: JobPeers | None,
        nodes: int = 1,
    ) -> None:
        """Names this node's ranks among `verdicts` (event each window, console
        rate-limited); with ``straggler_restart`` asks once to exclude this node."""
        now = time.monotonic()
        window = mine.rhythm.window
        scope = "the node's" if peers is None else "the job's"
        for global_rank, ratio in sorted(verdicts.items()):
            if global_rank not in mine.local_ranks:
                continue  # another node's rank: that node names it
            fields = {
                "global_rank": global_rank,
                "local_rank": mine.local_ranks[global_rank],
                "host": hosts[global_rank],
                "ratio": round(ratio, 3),
                "step_time": step_times[global_rank],
                "window": window,
                "attempt": mine.attempt,
                "ranks_compared": len(step_times),
                "nodes_compared": nodes,
            }
            self._emit(Event.STRAGGLER, fields)
            last = self._logged.get(global_rank)
            if last is None or now - last >= STRAGGLER_LOG_EVERY:
                self._logged[global_rank] = now
                log.warning(
                    "rank %d on %s is a straggler: %.1fx slower per step than %s other "
                    "ranks over the last %.0f s",
                    global_rank,
                    fields["host"],
                    ratio,
                    scope,
                    window,
                )
            if self.config.straggler_restart:
                self._ask_exclusion(global_rank, mine.local_ranks[global_rank], ratio, peers)

    def _ask_exclusion(
        self, global_rank: int, local_rank: int, ratio: float, peers: JobPeers | None
    ) -> None:
        """``straggler_restart``: the node of a straggler leaves the job and the others
        restart without it, by the same path as a rank's request to exclude its node."""
        with self._lock:
            if self._exclusion_asked:
                return
            self._exclusion_asked = True
        if peers is None or not peers.elastic:
            log.warning(
                "rank %d is a straggler, but only a job of elastic membership (--nnodes "
                "MIN:MAX with another node) can go on without its node: not restarting",
                global_rank,
            )
            return
        reason = (
            f"rank {global_rank} is a straggler ({ratio:.1f}x slower per step than the job's "
            "other ranks; --straggler-restart)"
        )
        req = ControlRequest(
            action=ControlAction.EXCLUDE_NODE,
            global_rank=global_rank,
            local_rank=local_rank,
            pid=self._pid_of(local_rank),
            received_at=time.time(),
            reason=reason,
        )
        self._ask(req)
        log.warning("%s: asking to restart the job without this node", reason)
