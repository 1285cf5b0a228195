"""Ranks late by their rhythm, held until `evidence` says they are hung.

The scanner hands `Suspicions.confirm` the ranks whose first evidence look is due
(`judge.lookout`: one evidence window before the deadline, once the rank is late), each
marked past its deadline or not; it answers with those that are hung on evidence, each
with what its stack says. The first look only samples; the second, at the deadline
(`evidence.decision_at`), decides. A rank whose last progress moved in between (it
stepped) is no longer suspected and its first look is thrown away, so nothing is decided
on a look taken before a rank's latest progress.

When the first rank of an episode turns late, every rank that is not stopped is asked
for its stacks (the stacks blame is decided on, taken at detection); a stopped rank is
left stopped, its state being the evidence. Once no rank is late any more, the next
episode asks afresh: a dump taken during a slow phase that ended is never read for a
later hang. Within an episode, a rank found hung whose dump was asked for before the quiet
the samples show (it was busy then, restoring a checkpoint say, and waits now) is asked
again and judged on the new dump (`evidence.stack_look`).

Ranks found waiting on their peers are never handed over while another rank of the node
is not found hung (`_release`): killing a waiter whose peer is busy would be a false
kill. A verdict held that way is only as good as the quiet it was found in: before the
held ranks are handed over, each is sampled again, and one that ran code since it was
found hung is let go (ranks that take turns, one waiting while the other works, as in a
checkpoint save whose coordinator copies the step while the others wait for its answer,
would otherwise each be found quiet once and handed over together). The other way round, when a rank that is not waiting (the culprit) is found hung,
its victims are judged at that same moment (`judged_with`): a rank already late, or one
whose stack taken at the episode's start shows it waiting on its peers and that made no
progress since. Their own deadlines may fall a little later (a heartbeat written a few
ms after the culprit's, a learned timeout that grew); judged then, they would be judged
after the culprit was continued for its own dump and had let them run on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from stalwart.monitor import evidence
from stalwart.monitor.evidence import ProcSample, Reading, Role, StackLook

log = logging.getLogger(__name__)

Sampler = Callable[[int, float], ProcSample | None]
#: Asks a process for its stacks; True when the signal was sent.
AskStacks = Callable[[int], bool]


@dataclasses.dataclass
class _Suspect:
    pid: int
    since: float  # the rank's last progress when it was first looked at
    due: float
    first: ProcSample
    #: When to look again for a dump asked of it after it was found hung (None: none).
    recheck: float | None = None


@dataclasses.dataclass(frozen=True)
class Late:
    """A rank whose first evidence look is due, as the scanner found it."""

    pid: int  # the process that writes its slot
    since: float  # its last progress (`judge.Lookout.since`)
    due: float  # its deadline
    past: bool  # `judge` found it past that deadline in this scan


@dataclasses.dataclass(frozen=True)
class Watched:
    """A rank of the attempt as the suspicion part sees it."""

    pid: int  # the process that writes its slot
    stacks: Path | None  # where its stack dumps go
    #: Its last progress as of the scan (`judge.Lookout.since`; None: no deadline runs).
    since: float | None = None


@dataclasses.dataclass(frozen=True)
class Bystander:
    """A rank of the node not found hung, at the moment another one is."""

    late: bool  # late by its rhythm: its first evidence look was due
    #: Its last progress (None: unknown) and when the episode asked for its stacks
    #: (None: it was not asked); its stack says where it was at that ask.
    since: float | None
    asked_at: float | None
    reading: Reading


def judged_with(hung: Mapping[int, Reading], others: Mapping[int, Bystander]) -> list[int]:
    """The ranks of `others` to judge hung together with `hung` (pure): none unless a
    rank in `hung` is not waiting on its peers (a culprit); then each rank already late,
    and each whose stack at the episode's ask shows it waiting on its peers and that has
    made no progress since that ask (a later step would make that stack stale)."""
    if all(r.role is Role.WAITING for r in hung.values()):
        return []
    out: list[int] = []
    for lr, b in sorted(others.items()):
        if lr in hung:
            continue
        stale = b.since is None or b.asked_at is None or b.since > b.asked_at
        if b.late or (b.reading.role is Role.WAITING and not stale):
            out.append(lr)
    return out


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
        #: local rank -> its sample when its stacks were last asked for
        self._asked: dict[int, ProcSample] = {}
        self._reasked: set[int] = set()  # asked again once found hung: wait for that dump
        self._asked_at: float | None = None  # when this episode asked for stacks
        self._held: dict[int, Reading] = {}  # found hung, waiting for their peers' verdicts
        #: local rank -> the sample that found a held rank hung (the quiet it was held in)
        self._held_quiet: dict[int, ProcSample] = {}

    def reset(self) -> None:
        self._suspects = {}
        self._offsets = {}
        self._asked = {}
        self._reasked = set()
        self._asked_at = None
        self._held = {}
        self._held_quiet = {}

    def confirm(
        self, late: Mapping[int, Late], ranks: Mapping[int, Watched], now: float
    ) -> dict[int, Reading]:
        """`late`: local rank -> the ranks whose first look is due in this scan.
        Returns local rank -> stack reading for those hung on evidence, and for the
        victims judged with them (`judged_with`)."""
        for lr, was in list(self._suspects.items()):
            seen = late.get(lr)
            if seen is None or seen.pid != was.pid or seen.since != was.since:
                del self._suspects[lr]  # progress again: what was seen is another stall
        for lr in [lr for lr in self._held if lr not in late or not late[lr].past]:
            del self._held[lr]
            self._held_quiet.pop(lr, None)
        if not late and not self._held:
            self._asked_at = None  # the episode is over: a later one asks afresh
            self._offsets = {}
            self._asked = {}
            self._reasked = set()
        if late and self._asked_at is None:
            self._ask_everyone(ranks, now)
        hung: dict[int, Reading] = {}
        quiet: dict[int, ProcSample] = {}  # the samples that found them hung
        for lr, seen in late.items():
            suspect = self._suspects.get(lr)
            if suspect is None:
                first = self._sample(seen.pid, now)
                if first is not None:
                    self._suspects[lr] = _Suspect(seen.pid, seen.since, seen.due, first)
                continue
            suspect.due = seen.due  # a learned timeout may have grown since
            if not seen.past or now < evidence.decision_at(suspect.first.at, seen.due, self._wait):
                continue
            second = self._sample(seen.pid, now)
            if second is None:
                del self._suspects[lr]
                continue
            if evidence.is_hung(suspect.first, second):
                stopped = second.state in ("T", "t") or suspect.first.state in ("T", "t")
                watched = ranks.get(lr)
                look = self._stack_look(lr, watched, stopped, second)
                if look is StackLook.ASK and watched is not None:
                    self._ask_one(lr, watched, second)
                    self._reasked.add(lr)
                if look is not StackLook.READ:
                    suspect.recheck = now + evidence.DUMP_POLL
                    continue
                hung[lr] = evidence.role(self._stacks_of(lr, watched), stopped)
                quiet[lr] = second
                del self._suspects[lr]
            else:
                suspect.first = second  # running code: look again a window later
                suspect.recheck = None
        if hung:
            others = {
                lr: self._bystander(lr, w, lr in late)
                for lr, w in ranks.items()
                if lr not in self._held
            }
            for lr in judged_with(hung, others):
                hung[lr] = others[lr].reading
                self._suspects.pop(lr, None)
        return self._release(hung, quiet, ranks, now)

    def next_look(self) -> float | None:
        """Monotonic time of the earliest second look due (None: no rank is suspected),
        for the scanner to wake then instead of up to a check interval later."""
        times = [
            s.recheck
            if s.recheck is not None
            else evidence.decision_at(s.first.at, s.due, self._wait)
            for s in self._suspects.values()
        ]
        return min(times) if times else None

    def _stack_look(
        self, lr: int, watched: Watched | None, stopped: bool, now: ProcSample
    ) -> StackLook:
        stacks = watched.stacks if watched is not None else None
        dumped = False
        if stacks is not None:
            try:
                dumped = stacks.stat().st_size > self._offsets.get(lr, 0)
            except OSError:
                dumped = False
        # The episode's own ask came a window or more before: its dump is what there is.
        patience = evidence.DUMP_PATIENCE if lr in self._reasked else 0.0
        return evidence.stack_look(
            stopped, stacks is not None, self._asked.get(lr), now, dumped, patience
        )

    def _bystander(self, lr: int, watched: Watched, late: bool) -> Bystander:
        suspect = self._suspects.get(lr)
        stopped = suspect is not None and suspect.first.state in ("T", "t")
        at_ask = self._asked.get(lr)
        asked_at = at_ask.at if at_ask is not None else None
        if watched.since is not None and asked_at is not None and watched.since > asked_at:
            # It progressed after the ask: the stack dumped then says nothing of now.
            return Bystander(late, watched.since, asked_at, Reading(Role.UNKNOWN, "stale stack"))
        reading = evidence.role(self._stacks_of(lr, watched), stopped)
        return Bystander(late, watched.since, asked_at, reading)

    def _release(
        self,
        hung: dict[int, Reading],
        quiet: dict[int, ProcSample],
        ranks: Mapping[int, Watched],
        now: float,
    ) -> dict[int, Reading]:
        """Holds ranks found waiting on their peers as long as another rank of the node
        is not found hung: that one is at work (a slow checkpoint, an evaluation) or not
        yet judged, and the waiters will go on when it does. When only waiters are left
        on the node (a deadlock between collectives, or a culprit on another node whose
        monitor handles it) they are released together. Ranks held from an earlier scan
        are released only if still quiet (`_still_quiet`)."""
        if hung:
            for lr in [lr for lr in self._held if lr not in hung]:
                if not self._still_quiet(lr, ranks.get(lr), now):
                    del self._held[lr]
                    self._held_quiet.pop(lr, None)
        self._held.update(hung)
        self._held_quiet.update(quiet)
        if not self._held:
            return {}
        victims_only = all(r.role is Role.WAITING for r in self._held.values())
        if victims_only and any(lr not in self._held for lr in ranks):
            return {}
        out, self._held, self._held_quiet = self._held, {}, {}
        return out

    def _still_quiet(self, lr: int, watched: Watched | None, now: float) -> bool:
        """Whether a held rank ran no code since the sample that found it hung (the same
        evidence rule, over the time since); one that did was waiting on a peer that was
        at work, and is at work itself now."""
        was = self._held_quiet.get(lr)
        if was is None or watched is None:
            return True  # a victim judged with its culprit: held no longer than a scan
        fresh = self._sample(watched.pid, now)
        if fresh is None:
            return True  # gone: its exit is reported as such
        return fresh.at <= was.at or evidence.is_hung(was, fresh)

    def _ask_everyone(self, ranks: Mapping[int, Watched], now: float) -> None:
        self._asked_at = now
        for lr, watched in ranks.items():
            first = self._sample(watched.pid, now)
            if first is None or first.state in ("T", "t"):
                continue  # a stopped rank stays stopped: its state is the evidence
            self._ask_one(lr, watched, first)

    def _ask_one(self, lr: int, watched: Watched, sample: ProcSample) -> None:
        """Asks one rank for its stacks; what it writes from now on is read for it."""
        if watched.stacks is not None:
            try:
                self._offsets[lr] = watched.stacks.stat().st_size
            except OSError:
                self._offsets[lr] = 0
        self._asked[lr] = sample
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
