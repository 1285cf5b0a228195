"""Where the wall-clock time of a run went, computed from its event log alone.

``account(events)`` is a pure function of the records in ``events.jsonl`` (the
launcher's and the workers'), so the end-of-job summary, ``stalwart report`` and the
metrics all say the same thing.  The categories (docs/goodput.md defines them):

* ``startup``: the launcher's process start (``process_start`` of its
  ``launcher_start`` record) to the first training step (first attempt), and a
  restarted attempt's worker start to its first step;
* ``productive``: training steps whose work was kept;
* ``recompute``: training time of a failed attempt past the step the next attempt
  resumed from (past the last checkpoint): work done twice;
* ``checkpoint_stall``: time the training loop was blocked saving checkpoints;
* ``detection``: fault to the launcher knowing (a crash's exit, a hang's last heartbeat);
* ``teardown``: the launcher knowing to the attempt's workers all stopped, and the
  launcher's own exit;
* ``restart``: the end of a failed attempt to the next attempt's workers starting
  (rendezvous included);
* ``idle``: this node's workers done, waiting for other nodes.

Each fault also gets two durations beside its cost: fault -> the next attempt's first
step, and fault -> back at full speed (``full_speed_at``): a restart that leaves work
behind (a writer still starting, pages still faulting in) is first-stepped but slow.

The categories partition the run: they add up to its wall-clock time.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

from stalwart.base.events import Event

CATEGORIES = (
    "productive",
    "startup",
    "detection",
    "teardown",
    "restart",
    "recompute",
    "checkpoint_stall",
    "idle",
)

_OUTCOMES = {
    Event.RESTART: "failed",
    Event.JOB_FAILED: "failed",
    Event.JOB_SUCCEEDED: "succeeded",
    Event.JOB_STOPPED: "stopped",
}


@dataclass
class Fault:
    """One failed attempt: what failed and what it cost (seconds)."""

    attempt: int
    kind: str  # "crash", "exit", "hang", "peer" or "unknown"
    rank: int | None
    detail: str
    at: float  # wall-clock time of the fault
    cost: float = 0.0  # detection + teardown + restart + next start-up + recompute
    steps_lost: int = 0
    # Fault -> the next attempt's first step, and -> back at full speed (see
    # full_speed_at); None when the next attempt reported no steps (or never got there).
    first_step_s: float | None = None
    full_speed_s: float | None = None


@dataclass
class Attempt:
    attempt: int
    outcome: str  # "succeeded", "failed", "stopped" or "running"
    start: float  # workers started (wall clock)
    end: float
    first_step: int | None = None
    last_step: int | None = None
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))


@dataclass
class Breakdown:
    start: float
    end: float
    seconds: dict[str, float]
    attempts: list[Attempt]
    faults: list[Fault]
    steps_known: bool  # False: no worker reported steps, so start-up and recompute are 0

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def goodput(self) -> float:
        """Productive share of the wall-clock time (0 for an empty run)."""
        return self.seconds["productive"] / self.wall if self.wall > 0 else 0.0

    @property
    def lost(self) -> float:
        return self.wall - self.seconds["productive"]

    @property
    def steps_lost(self) -> int:
        return sum(f.steps_lost for f in self.faults)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(wall=self.wall, goodput=self.goodput, lost=self.lost, steps_lost=self.steps_lost)
        return out


def _t(ev: dict[str, Any]) -> float:
    return float(ev["time"])


def _step_time(samples: list[tuple[float, int]], step: int) -> float | None:
    """When an attempt reached *step*, interpolated between its sampled (time, step)s."""
    before: tuple[float, int] | None = None
    for t, s in samples:
        if s >= step:
            if before is None or s == before[1]:
                return t
            t0, s0 = before
            return t0 + (t - t0) * (step - s0) / (s - s0)
        before = (t, s)
    return None


def last_step_end(samples: list[tuple[float, int]]) -> float:
    """When the last sampled step ended, taking it as long as the attempt's mean step."""
    (t0, s0), (t1, s1) = samples[0], samples[-1]
    mean = (t1 - t0) / (s1 - s0) if s1 > s0 else 0.0
    return t1 + mean


# "Back at full speed": the step rate over a window of steps that spans at least one
# checkpoint interval is within this fraction of the rate before the fault.
FULL_SPEED = 0.9
DEFAULT_WINDOW_STEPS = 10


def window_steps(commit_steps: list[int]) -> int:
    """The window over which a rate is judged: the usual gap between saves (so a window
    holds one), or DEFAULT_WINDOW_STEPS when the run saved fewer than twice."""
    steps = sorted(set(commit_steps))
    gaps = sorted(b - a for a, b in itertools.pairwise(steps) if b > a)
    return max(1, gaps[len(gaps) // 2]) if gaps else DEFAULT_WINDOW_STEPS


def _rate(samples: list[tuple[float, int]], lo: int, hi: int) -> float | None:
    t_lo, t_hi = _step_time(samples, lo), _step_time(samples, hi)
    if t_lo is None or t_hi is None or t_hi <= t_lo or hi <= lo:
        return None
    return (hi - lo) / (t_hi - t_lo)


def full_speed_at(
    before: list[tuple[float, int]], after: list[tuple[float, int]], window: int
) -> float | None:
    """When the attempt sampled by *after* ((time, step) pairs, sorted) is back at full
    speed: the start of its first span of two windows of *window* steps (two checkpoint
    intervals, so a save that stalls after a fast first interval is caught) whose rate is
    at least FULL_SPEED of the failed attempt's (*before*, its first window left out as
    warm-up where it has more); an attempt shorter than the span is judged whole.  None
    if no span gets there, or either side has too few samples.  Not "stays there for
    good": on a shared machine a later load spike would make that measure the machine."""
    if len(before) < 2 or len(after) < 2:
        return None
    first, last = before[0][1], before[-1][1]
    ref = _rate(before, first + window, last) if last - first > 2 * window else None
    ref = ref if ref is not None else _rate(before, first, last)
    if ref is None:
        return None
    start, span = after[0][1], 2 * window
    ends = [s_j for _t, s_j in after if s_j - span >= start] or [after[-1][1]]
    for s_j in ends:
        lo = max(start, s_j - span)
        rate = _rate(after, lo, s_j)
        if rate is not None and rate >= FULL_SPEED * ref:
            return _step_time(after, lo)
    return None


def _fault(attempt: int, evs: list[dict[str, Any]], outcome_ev: dict[str, Any]) -> Fault:
    hangs = [e for e in evs if e["event"] == Event.HANG_DETECTED]
    if hangs:
        h = min(hangs, key=_t)
        age = h.get("last_heartbeat_age")
        onset = _t(h) - float(age) if isinstance(age, int | float) else _t(h)
        return Fault(attempt, "hang", h.get("global_rank"), f"{h.get('kind')} timeout", onset)
    cause = outcome_ev.get("root_cause") or {}
    if cause:
        sig = cause.get("signal")
        kind = "crash" if sig else "exit"
        detail = f"signal {sig}" if sig else f"exit code {cause.get('exitcode')}"
        at = float(cause.get("timestamp") or _t(outcome_ev))
        return Fault(attempt, kind, cause.get("rank"), detail, at)
    if any(e["event"] == Event.PEER_FAILURE for e in evs):
        peer = min((e for e in evs if e["event"] == Event.PEER_FAILURE), key=_t)
        return Fault(attempt, "peer", None, "another node failed", _t(peer))
    return Fault(attempt, "unknown", None, "", _t(outcome_ev))


def _detected(fault: Fault, evs: list[dict[str, Any]], end: float) -> float:
    """When the launcher knew: the hang report, the first failed exit, a peer's flag."""
    if fault.kind == "hang":
        return min(_t(e) for e in evs if e["event"] == Event.HANG_DETECTED)
    seen = [
        _t(e)
        for e in evs
        if (e["event"] == Event.WORKER_EXIT and e.get("exitcode") not in (0, None))
        or e["event"] == Event.PEER_FAILURE
    ]
    return min(seen) if seen else end


# A launcher's own start-up (interpreter, imports, settings) before its launcher_start
# record takes seconds, tens under load; a process_start further back than this is a
# clock step or a hand-edited record, not start-up.
MAX_LAUNCHER_STARTUP = 3600.0


def began_at(launcher_start: dict[str, Any]) -> float:
    """When the run began: its launcher's process start (``process_start``), which
    precedes the ``launcher_start`` record by the launcher's own start-up; the record's
    time where that field is missing or implausible."""
    t = _t(launcher_start)
    began = launcher_start.get("process_start")
    if isinstance(began, bool) or not isinstance(began, int | float):
        return t
    return float(began) if t - MAX_LAUNCHER_STARTUP <= began <= t else t


def account(events: list[dict[str, Any]], now: float | None = None) -> Breakdown:
    """The breakdown of a run from its events; *now* ends a run still under way."""
    launcher = [e for e in events if e.get("source") != "worker" and "time" in e]
    starts = [e for e in launcher if e["event"] == Event.LAUNCHER_START]
    t0 = began_at(starts[0]) if starts else (min(map(_t, launcher)) if launcher else 0.0)
    exits = [e for e in launcher if e["event"] == Event.LAUNCHER_EXIT]
    if exits:
        t_end = _t(exits[-1])
    elif now is not None:
        t_end = now
    else:
        t_end = max((_t(e) for e in events if "time" in e), default=t0)

    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        a = e.get("attempt")
        if isinstance(a, int) and a >= 0 and "time" in e:
            by_attempt.setdefault(a, []).append(e)
    numbers = sorted(
        a
        for a, evs in by_attempt.items()
        if any(x["event"] in (Event.RENDEZVOUS_DONE, Event.WORKER_SPAWN) for x in evs)
    )

    def samples(a: int) -> list[tuple[float, int]]:
        return sorted(
            (float(e.get("step_time") or e["time"]), int(e["step"]))
            for e in by_attempt.get(a, [])
            if e["event"] == Event.PROGRESS and isinstance(e.get("step"), int)
        )

    total = dict.fromkeys(CATEGORIES, 0.0)
    attempts: list[Attempt] = []
    faults: list[Fault] = []
    steps_known = False
    cursor = t0  # everything before it is accounted for
    pending_fault: Fault | None = None

    def add(row: Attempt, cat: str, until: float) -> None:
        nonlocal cursor
        until = min(max(until, cursor), t_end)
        span = until - cursor
        row.seconds[cat] += span
        total[cat] += span
        if pending_fault is not None and cat != "productive":
            pending_fault.cost += span
        cursor = until

    for i, a in enumerate(numbers):
        evs = sorted(by_attempt[a], key=_t)
        spawns = [_t(e) for e in evs if e["event"] == Event.WORKER_SPAWN]
        rdzv = [_t(e) for e in evs if e["event"] == Event.RENDEZVOUS_DONE]
        w = min(spawns) if spawns else (rdzv[0] if rdzv else cursor)
        outcome_evs = [e for e in evs if e["event"] in _OUTCOMES and e.get("source") != "worker"]
        out_ev = outcome_evs[0] if outcome_evs else None
        e_a = _t(out_ev) if out_ev is not None else t_end
        row = Attempt(a, _OUTCOMES[out_ev["event"]] if out_ev else "running", w, e_a)
        sm = samples(a)
        if sm:
            steps_known = True
            row.first_step = min(s for _, s in sm)
            row.last_step = max(s for _, s in sm)
        first_t = min((t for t, _ in sm), default=None)

        if i == 0:
            add(row, "startup", first_t if first_t is not None else w)
        else:
            add(row, "restart", w)
            add(row, "startup", first_t if first_t is not None else w)
        # The previous fault's cost ends when this attempt trains again.
        pending_fault = None

        run_start = cursor
        stall = sum(
            float(e.get("stall_s") or 0.0)
            for e in evs
            if e["event"] == Event.CHECKPOINT_COMMIT and e.get("rank") in (None, 0)
        )
        if row.outcome == "failed" and out_ev is not None:
            fault = _fault(a, evs, out_ev)
            detected = max(_detected(fault, evs, e_a), fault.at)
            run_end = min(max(fault.at, run_start), e_a)
            # Work past the step the next attempt resumed from is done twice.
            lost_from: float | None = None
            nxt = samples(numbers[i + 1]) if i + 1 < len(numbers) else []
            if sm and nxt:
                resume = min(s for _, s in nxt)
                lost_from = _step_time(sm, resume)
                if lost_from is not None and row.last_step is not None:
                    fault.steps_lost = max(0, row.last_step - resume + 1)
            if lost_from is None:
                commits = [
                    _t(e) for e in evs if e["event"] == Event.CHECKPOINT_COMMIT and _t(e) <= run_end
                ]
                if commits:
                    lost_from = max(commits)
            lost_from = run_end if lost_from is None else min(max(lost_from, run_start), run_end)
            productive_until = lost_from - min(stall, max(0.0, lost_from - run_start))
            add(row, "productive", productive_until)
            add(row, "checkpoint_stall", lost_from)
            pending_fault = fault
            add(row, "recompute", run_end)
            add(row, "detection", detected)
            add(row, "teardown", e_a)
            faults.append(fault)
        elif row.outcome == "succeeded":
            done = [
                float(e.get("exited_at") or _t(e)) for e in evs if e["event"] == Event.WORKER_EXIT
            ]
            exited = max(done) if done else e_a
            # Training ends with the last step; workers then wind down (teardown).
            run_end = exited if not sm else min(exited, last_step_end(sm))
            add(row, "productive", run_end - min(stall, max(0.0, run_end - run_start)))
            add(row, "checkpoint_stall", run_end)
            add(row, "teardown", exited)
            add(row, "idle", e_a)
        elif row.outcome == "stopped":
            shut = [_t(e) for e in launcher if e["event"] == Event.SHUTDOWN and _t(e) <= e_a]
            run_end = shut[-1] if shut else e_a
            add(row, "productive", run_end - min(stall, max(0.0, run_end - run_start)))
            add(row, "checkpoint_stall", run_end)
            add(row, "teardown", e_a)
        else:
            add(row, "productive", e_a - min(stall, max(0.0, e_a - run_start)))
            add(row, "checkpoint_stall", e_a)
        attempts.append(row)

    window = window_steps(
        [
            int(e["step"])
            for e in events
            if e.get("event") == Event.CHECKPOINT_COMMIT and isinstance(e.get("step"), int)
        ]
    )
    for fault in faults:
        later = [a for a in numbers if a > fault.attempt]
        after = samples(later[0]) if later else []
        if after:
            fault.first_step_s = max(0.0, after[0][0] - fault.at)
            back = full_speed_at(samples(fault.attempt), after, window)
            fault.full_speed_s = None if back is None else max(0.0, back - fault.at)

    # The launcher's own exit is no fault's doing.
    pending_fault = None
    tail = Attempt(-1, "", cursor, t_end)
    add(tail, "teardown", t_end)
    return Breakdown(t0, t_end, total, attempts, faults, steps_known)
