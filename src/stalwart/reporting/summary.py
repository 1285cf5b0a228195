"""The end-of-job block on the console, and the check that injected faults fired.

Both are pure functions of the run's events (plus what the launcher knows), so the
block a user sees is what ``stalwart report`` shows for the same run.
"""

from __future__ import annotations

from typing import Any

from stalwart import inject
from stalwart.base.events import Event
from stalwart.reporting.goodput import CATEGORIES, Breakdown, account
from stalwart.reporting.quarantine import quarantine_lines


def never_fired(spec: str, events: list[dict[str, Any]], ranks: set[int]) -> list[str]:
    """The faults of *spec* that hit one of this node's *ranks* and never fired."""
    if not spec:
        return []
    fired = {e.get("fault") for e in events if e.get("event") == Event.FAULT_INJECTED}
    return [
        f.text
        for f in inject.parse(spec)
        if f.text not in fired and (f.rank is None or f.rank in ranks)
    ]


def _secs(value: float) -> str:
    return f"{value:.1f} s" if value < 120 else f"{value / 60:.1f} min"


def format_block(
    b: Breakdown,
    *,
    run_id: str,
    outcome: str,
    attempts: int,
    run_dir: str | None,
    quarantined: list[str] | None = None,
) -> str:
    """One short block: outcome, faults and their cost, steps lost, goodput, run folder."""
    lines = [
        f"stalwart: job {run_id} {outcome} after {attempts} attempt(s) in {_secs(b.wall)}",
    ]
    for f in b.faults:
        who = f"rank {f.rank}" if f.rank is not None else "a peer node"
        lost = f", {f.steps_lost} step(s) redone" if f.steps_lost else ""
        back = ""
        if f.first_step_s is not None:
            full = "not reached" if f.full_speed_s is None else _secs(f.full_speed_s)
            back = f"; first step after {_secs(f.first_step_s)}, full speed after {full}"
        lines.append(
            f"  fault in attempt {f.attempt}: {who} {f.kind} ({f.detail}), "
            f"cost {_secs(f.cost)}{lost}{back}"
        )
    lines.extend(f"  {q}" for q in quarantined or [])
    if b.steps_known or b.faults:
        costs = [
            f"{cat.replace('_', ' ')} {_secs(b.seconds[cat])}"
            for cat in CATEGORIES[1:]
            if b.seconds[cat] >= 0.05
        ]
        lines.append(
            f"  goodput {100 * b.goodput:.1f}% ({_secs(b.seconds['productive'])} productive"
            + (f"; {', '.join(costs)}" if costs else "")
            + ")"
        )
        if len(b.faults) > 1 and b.steps_lost:
            lines.append(f"  steps lost to faults: {b.steps_lost}")
    if not b.steps_known:
        lines.append("  (no step reports: call stalwart.inject.step(step) for goodput)")
    if run_dir:
        lines.append(f"  run folder: {run_dir}")
    return "\n".join(lines)


def end_block(
    events: list[dict[str, Any]],
    *,
    now: float,
    run_id: str,
    outcome: str,
    attempts: int,
    run_dir: str | None,
) -> tuple[str, Breakdown]:
    b = account(events, now=now)
    block = format_block(
        b,
        run_id=run_id,
        outcome=outcome,
        attempts=attempts,
        run_dir=run_dir,
        quarantined=quarantine_lines(events),
    )
    return block, b
