"""``stalwart report PATH``: what happened in a run, read back from ``events.jsonl``.

PATH is a run folder, an ``events.jsonl`` or a log dir holding several runs; for a log
dir the runs are listed first and the newest (or ``--run ID``) is shown.  The numbers
come from ``goodput.account``, the same function the end-of-job summary uses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from stalwart.base.events import Event
from stalwart.launch.events import read_events
from stalwart.launch.goodput import CATEGORIES, Breakdown, account


def find_runs(path: Path) -> list[Path]:
    """The events files under *path*, oldest first (by their first event's time)."""
    if path.is_file():
        return [path]
    direct = path / "events.jsonl"
    if direct.is_file():
        return [direct]
    found = list(path.glob("*/events.jsonl"))
    if not found:
        raise FileNotFoundError(f"no events.jsonl under {path}")
    return sorted(found, key=_started)


def _started(path: Path) -> float:
    for ev in read_events(path):
        return float(ev.get("time", 0.0))
    return 0.0


def _outcome(events: list[dict[str, Any]]) -> str:
    for ev in reversed(events):
        kind = ev.get("event")
        if kind == Event.JOB_SUCCEEDED:
            return "succeeded"
        if kind == Event.JOB_FAILED:
            return "failed"
        if kind == Event.JOB_STOPPED:
            return "stopped"
        if kind == Event.RENDEZVOUS_ERROR:
            return "rendezvous error"
    return "running" if not any(e.get("event") == Event.LAUNCHER_EXIT for e in events) else "ended"


def summarise(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per attempt: world size, when its workers started and ended, outcome,
    root cause, and its share of the breakdown."""
    b = account(events)
    causes: dict[int, str] = {}
    sizes: dict[int, Any] = {}
    for ev in events:
        attempt = ev.get("attempt")
        if not isinstance(attempt, int):
            continue
        if ev["event"] == Event.RENDEZVOUS_DONE:
            sizes[attempt] = ev.get("world_size")
        cause = ev.get("root_cause") if ev["event"] in (Event.RESTART, Event.JOB_FAILED) else None
        if cause:
            how = (
                f"signal {cause['signal']}"
                if cause.get("signal")
                else f"exit {cause.get('exitcode')}"
            )
            why = cause.get("reason") or cause.get("message") or ""
            causes[attempt] = f"rank {cause.get('rank')} {how} {why}".strip()
    rows = []
    for a in b.attempts:
        rows.append(
            {
                "attempt": a.attempt,
                "world_size": sizes.get(a.attempt),
                "start": a.start,
                "end": a.end,
                "outcome": a.outcome,
                "cause": causes.get(a.attempt, ""),
                "first_step": a.first_step,
                "last_step": a.last_step,
                "seconds": a.seconds,
            }
        )
    return rows


def run_record(path: Path) -> dict[str, Any]:
    """Everything ``--json`` prints for one run."""
    events = list(read_events(path))
    b = account(events)
    return {
        "run_id": events[0].get("run_id") if events else None,
        "events": str(path),
        "outcome": _outcome(events),
        "breakdown": b.to_dict(),
        "attempts": summarise(events),
        "exit_code": next(
            (e.get("exit_code") for e in reversed(events) if e["event"] == Event.LAUNCHER_EXIT),
            None,
        ),
    }


def _fmt(v: float) -> str:
    return f"{v:.2f}"


def _print_runs(console: Console, runs: list[Path], chosen: Path) -> None:
    table = Table(title=f"{len(runs)} runs")
    for col in ("run", "started", "outcome", "attempts", "wall s", "goodput"):
        table.add_column(col)
    for path in runs:
        events = list(read_events(path))
        b = account(events)
        mark = " *" if path == chosen else ""
        table.add_row(
            f"{path.parent.name}{mark}",
            _when(b.start),
            _outcome(events),
            str(len(b.attempts)),
            _fmt(b.wall),
            f"{100 * b.goodput:.1f}%",
        )
    console.print(table)


def _when(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _print_run(console: Console, path: Path) -> None:
    events = list(read_events(path))
    b: Breakdown = account(events)
    table = Table(title=f"run {events[0].get('run_id') if events else '?'} ({path})")
    for col in (
        "attempt",
        "world size",
        "duration s",
        "steps",
        "productive s",
        "lost s (largest)",
        "outcome",
        "root cause",
    ):
        table.add_column(col)
    for row in summarise(events):
        steps = f"{row['first_step']}..{row['last_step']}" if row["first_step"] is not None else ""
        secs: dict[str, float] = row["seconds"]
        lost = {k: v for k, v in secs.items() if k != "productive"}
        worst = max(lost, key=lambda k: lost[k])
        table.add_row(
            str(row["attempt"]),
            str(row["world_size"] or ""),
            _fmt(row["end"] - row["start"]),
            steps,
            _fmt(secs["productive"]),
            f"{_fmt(sum(lost.values()))} ({worst})" if lost[worst] > 0 else "0.00",
            row["outcome"],
            row["cause"],
        )
    console.print(table)
    breakdown = Table(title=f"where the time went (goodput {100 * b.goodput:.1f}%)")
    breakdown.add_column("category")
    breakdown.add_column("seconds", justify="right")
    breakdown.add_column("share", justify="right")
    for cat in CATEGORIES:
        share = b.seconds[cat] / b.wall if b.wall > 0 else 0.0
        breakdown.add_row(cat, _fmt(b.seconds[cat]), f"{100 * share:.1f}%")
    breakdown.add_row("total", _fmt(b.wall), "100.0%")
    console.print(breakdown)
    if b.faults:
        faults = Table(title="faults")
        for col in ("attempt", "rank", "kind", "detail", "cost s", "steps redone"):
            faults.add_column(col)
        for f in b.faults:
            faults.add_row(
                str(f.attempt),
                "" if f.rank is None else str(f.rank),
                f.kind,
                f.detail,
                _fmt(f.cost),
                str(f.steps_lost),
            )
        console.print(faults)
    last = events[-1] if events else {}
    if last.get("event") == Event.LAUNCHER_EXIT:
        console.print(f"launcher exit code: {last.get('exit_code')}")


def _write_atomic(path: Path, data: bytes) -> None:
    """Nothing half-written: a temp file beside the target, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def report_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="stalwart report")
    parser.add_argument("path", type=Path, help="run folder, log dir, or events.jsonl")
    parser.add_argument("--run", default=None, help="run id to show when PATH holds several")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.add_argument("--html", type=Path, default=None, help="write a self-contained page")
    parser.add_argument("--png", type=Path, default=None, help="write the timeline as an image")
    ns = parser.parse_args(argv)
    try:
        runs = find_runs(ns.path)
    except FileNotFoundError as err:
        print(f"stalwart report: error: {err}", file=sys.stderr)
        return 2
    chosen = runs[-1]
    if ns.run is not None:
        match = [p for p in runs if p.parent.name == ns.run]
        if not match:
            names = ", ".join(p.parent.name for p in runs)
            print(
                f"stalwart report: error: --run {ns.run!r} is not a run under {ns.path} "
                f"(runs: {names})",
                file=sys.stderr,
            )
            return 2
        chosen = match[0]
    if ns.html is not None or ns.png is not None:
        from stalwart.launch import timeline

        tl = timeline.build(list(read_events(chosen)))
        try:
            if ns.html is not None:
                _write_atomic(ns.html, timeline.to_html(tl).encode())
            if ns.png is not None:
                tmp = ns.png.with_name(f".{ns.png.name}.tmp.png")
                try:
                    timeline.to_png(tl, tmp)
                    tmp.replace(ns.png)
                finally:
                    tmp.unlink(missing_ok=True)
        except (OSError, RuntimeError) as err:
            print(f"stalwart report: error: {err}", file=sys.stderr)
            return 2
        if not ns.json:
            return 0
    if ns.json:
        out = {"runs": [run_record(p) for p in runs], "chosen": str(chosen)}
        json.dump(out, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
        return 0
    console = Console()
    if len(runs) > 1:
        _print_runs(console, runs, chosen)
    _print_run(console, chosen)
    return 0
