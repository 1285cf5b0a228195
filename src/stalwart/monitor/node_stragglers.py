"""Stragglers: ranks measurably slower per step than the others.

Every ``straggler_window`` the scanner measures each rank's seconds per step; alone on
its node it compares them here, in a job of several nodes the sync thread compares
them with the job's (`node_sync`). A straggler is named (an event each window, a
console line at most every STRAGGLER_LOG_EVERY) and, with ``straggler_restart``, its
node asks to leave the job.
"""

from __future__ import annotations

import logging
import socket
import time

from stalwart.base.events import Event
from stalwart.monitor.jobsync import JobPeers, NodeRhythm
from stalwart.monitor.judge import stragglers
from stalwart.monitor.node_state import NodeState, _Rank, _Window
from stalwart.monitor.reports import ControlAction, ControlRequest

log = logging.getLogger(__name__)

STRAGGLER_LOG_EVERY = 60.0


class NodeStragglers(NodeState):
    """Straggler windows of a node monitor."""

    def _check_stragglers(self, ranks: list[_Rank]) -> None:
        """Every straggler_window: measures the ranks' seconds per step over the window
        just ended; compares them with the node's other ranks, or, when the job has
        other nodes, hands them to the sync thread to compare with the job's."""
        now = time.monotonic()
        window = self.config.straggler_window
        if self._straggler_due == 0.0:
            self._straggler_due = now + window
        if now < self._straggler_due:
            return
        self._straggler_due = now + window
        step_times: dict[int, float] = {}
        local: dict[int, int] = {}
        for rank in ranks:
            recent = [p for p in rank.progress if p[0] >= now - window]
            rank.progress = recent[-1:]  # the window's last point starts the next one
            if len(recent) >= 2 and recent[-1][1] > recent[0][1]:
                step_times[rank.global_rank] = (recent[-1][0] - recent[0][0]) / (
                    recent[-1][1] - recent[0][1]
                )
                local[rank.global_rank] = rank.local_rank
        mine = NodeRhythm(socket.gethostname(), window, step_times)
        with self._lock:
            shared = self._peers is not None
            if shared:
                self._window = _Window(mine, local, self._attempt)
        if shared:
            self._sync_wake.set()
            return
        self._report_stragglers(
            stragglers(step_times, self.config.straggler_factor),
            step_times,
            dict.fromkeys(step_times, mine.host),
            _Window(mine, local, self._attempt),
            None,
        )

    def _report_stragglers(
        self,
        verdicts: dict[int, float],
        step_times: dict[int, float],
        hosts: dict[int, str],
        mine: _Window,
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
            last = self._straggler_logged.get(global_rank)
            if last is None or now - last >= STRAGGLER_LOG_EVERY:
                self._straggler_logged[global_rank] = now
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
            rank = self._ranks.get(local_rank)
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
            pid=rank.pid if rank is not None else 0,
            received_at=time.time(),
            reason=reason,
        )
        with self._lock:
            self._requests.append(req)
        log.warning("%s: asking to restart the job without this node", reason)
