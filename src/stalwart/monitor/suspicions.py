"""Ranks past a learned deadline, held until `evidence` says they are hung.

The scanner hands `Suspicions.confirm` the ranks its judge found past their deadline on
each scan; it answers with those that are hung on evidence, each with what its stack
says. At the first suspicion of an attempt every rank that is not stopped is asked for
its stacks (the stacks blame is decided on, taken at detection); a stopped rank is left
stopped, its state being the evidence. A rank that makes progress again, or shows it
runs code, is no longer suspected. Ranks found waiting on their peers are never handed
over while another rank of the node is not found hung (`_release`): killing a waiter
whose peer is busy would be a false kill.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from stalwart.monitor import evidence
from stalwart.monitor.evidence import ProcSample, Reading, Role

log = logging.getLogger(__name__)

Sampler = Callable[[int, float], ProcSample | None]
#: Asks a process for its stacks; True when the signal was sent.
AskStacks = Callable[[int], bool]


@dataclasses.dataclass
class _Suspect:
    pid: int
    first: ProcSample


@dataclasses.dataclass(frozen=True)
class Watched:
    """A rank of the attempt as the suspicion part sees it."""

    pid: int  # the process that writes its slot
    stacks: Path | None  # where its stack dumps go


class Suspicions:
    """One per node monitor; reset at each attempt."""

    def __init__(
        self,
        ask_stacks: AskStacks,
        sampler: Sampler = evidence.sample,
        wait: float = evidence.CONFIRM_WAIT,
    ) -> None:
        self._ask = ask_stacks
        self._sample = sampler
        self._wait = wait
        self._suspects: dict[int, _Suspect] = {}
        self._offsets: dict[int, int] = {}  # local rank -> size of its stacks file when asked
        self._asked = False
        self._held: dict[int, Reading] = {}  # found hung, waiting for their peers' verdicts

    def reset(self) -> None:
        self._suspects = {}
        self._offsets = {}
        self._asked = False
        self._held = {}

    def confirm(
        self, past: Mapping[int, int], ranks: Mapping[int, Watched], now: float
    ) -> dict[int, Reading]:
        """`past`: local rank -> pid of the ranks past their deadline in this scan.
        Returns local rank -> stack reading for those hung on evidence."""
        for lr in [lr for lr in self._suspects if lr not in past]:
            del self._suspects[lr]  # progress again: no longer suspected
        for lr in [lr for lr in self._held if lr not in past]:
            del self._held[lr]
        if past and not self._asked:
            self._ask_everyone(ranks, now)
        hung: dict[int, Reading] = {}
        for lr, pid in past.items():
            suspect = self._suspects.get(lr)
            if suspect is None or suspect.pid != pid:
                first = self._sample(pid, now)
                if first is not None:
                    self._suspects[lr] = _Suspect(pid, first)
                continue
            if now - suspect.first.at < self._wait:
                continue
            second = self._sample(pid, now)
            if second is None:
                del self._suspects[lr]
                continue
            if evidence.is_hung(suspect.first, second):
                stopped = second.state in ("T", "t") or suspect.first.state in ("T", "t")
                hung[lr] = evidence.role(self._stacks_of(lr, ranks.get(lr)), stopped)
                del self._suspects[lr]
            else:
                suspect.first = second  # running code: look again a window later
        return self._release(hung, ranks)

    def _release(
        self, hung: dict[int, Reading], ranks: Mapping[int, Watched]
    ) -> dict[int, Reading]:
        """Holds ranks found waiting on their peers as long as another rank of the node
        is not found hung: that one is at work (a slow checkpoint, an evaluation) or not
        yet judged, and the waiters will go on when it does. When only waiters are left
        on the node (a deadlock between collectives, or a culprit on another node whose
        monitor handles it) they are released together."""
        self._held.update(hung)
        if not self._held:
            return {}
        victims_only = all(r.role is Role.WAITING for r in self._held.values())
        if victims_only and any(lr not in self._held for lr in ranks):
            return {}
        out, self._held = self._held, {}
        return out

    def _ask_everyone(self, ranks: Mapping[int, Watched], now: float) -> None:
        self._asked = True
        for lr, watched in ranks.items():
            first = self._sample(watched.pid, now)
            if first is None or first.state in ("T", "t"):
                continue  # a stopped rank stays stopped: its state is the evidence
            if watched.stacks is not None:
                try:
                    self._offsets[lr] = watched.stacks.stat().st_size
                except OSError:
                    self._offsets[lr] = 0
            self._ask(watched.pid)

    def _stacks_of(self, lr: int, watched: Watched | None) -> str:
        if watched is None or watched.stacks is None or lr not in self._offsets:
            return ""
        try:
            with open(watched.stacks, "rb") as f:
                f.seek(self._offsets[lr])
                return f.read(evidence.MAX_STACK_CHARS).decode("utf-8", "replace")
        except OSError as exc:
            log.info("could not read stacks from %s: %s", watched.stacks, exc)
            return ""
