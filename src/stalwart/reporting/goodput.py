"""Where the wall-clock time of a run went, computed from its event log alone.

``account(events)`` is a pure function of the records in ``events.jsonl`` (the
launcher's and the workers'), so the end-of-job summary, ``stalwart report`` and the
metrics all say the same thing.  The categories (docs/goodput.md defines them):

* ``startup``: launcher start to the first training step (first attempt), and a
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

The categories partition the run: they add up to its wall-clock time.
"""

from __future__ import annotations

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


def account(events: list[dict[str, Any]], now: float | None = None) -> Breakdown:
    """The breakdown of a run from its events; *now* ends a run still under way."""
    launcher = [e for e in events if e.get("source") != "worker" and "time" in e]
    starts = [e for e in launcher if e["event"] == Event.LAUNCHER_START]
    t0 = _t(starts[0]) if starts else (min(map(_t, launcher)) if launcher else 0.0)
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

    # The launcher's own exit is no fault's doing.
    pending_fault = None
    tail = Attempt(-1, "", cursor, t_end)
    add(tail, "teardown", t_end)
    return Breakdown(t0, t_end, total, attempts, faults, steps_known)
