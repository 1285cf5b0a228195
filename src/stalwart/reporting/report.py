"""``stalwart report PATH``: what happened in a run, read back from ``events.jsonl``.

PATH is a run folder, an ``events.jsonl`` or a log dir holding several runs; for a log
dir the runs are listed first and the newest (or ``--run ID``) is shown.  The numbers
come from ``goodput.account``, the same function the end-of-job summary uses. A run
folder reused with the same run id holds several runs; the last one is shown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from stalwart.base.events import Event
from stalwart.base.files import replace_file
from stalwart.base.records import printable
from stalwart.reporting.goodput import CATEGORIES, Breakdown, account
from stalwart.reporting.quarantine import quarantine_lines, quarantines
from stalwart.reporting.read import last_run_start, read_events


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
    for ev in read_events(path, start=last_run_start(path)):
        return float(ev["time"])
    return 0.0


def run_events(path: Path) -> list[dict[str, Any]]:
    """The events of the last run in *path* (a reused run folder keeps earlier runs
    before it: they are not this run's)."""
    return list(read_events(path, start=last_run_start(path)))


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
        if cause:  # its fields' types were checked as the line was read
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
    events = run_events(path)
    b = account(events)
    return {
        "run_id": events[0].get("run_id") if events else None,
        "events": str(path),
        "outcome": _outcome(events),
        "breakdown": b.to_dict(),
        "attempts": summarise(events),
        "quarantined": [
            {"node": k.node, "since_attempt": k.since_attempt, "released": k.released}
            for k in quarantines(events)
        ],
        "exit_code": next(
            (e.get("exit_code") for e in reversed(events) if e["event"] == Event.LAUNCHER_EXIT),
            None,
        ),
    }


def _fmt(v: float) -> str:
    return f"{v:.2f}"


def _cell(value: object) -> Text:
    """A table cell from a record's value: never read as rich markup, control
    characters shown as escapes (a message cannot restyle or move the terminal)."""
    return Text(printable(str(value)))


def _print_runs(console: Console, runs: list[Path], chosen: Path) -> None:
    table = Table(title=f"{len(runs)} runs")
    for col in ("run", "started", "outcome", "tries", "wall s", "goodput"):
        table.add_column(col, overflow="fold")
    for path in runs:
        events = run_events(path)
        b = account(events)
        mark = " *" if path == chosen else ""
        table.add_row(
            _cell(f"{path.parent.name}{mark}"),
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


def _print_run(console: Console, path: Path, events: list[dict[str, Any]]) -> None:
    b: Breakdown = account(events)
    run_id = events[0].get("run_id") if events else "?"
    console.print(_cell(f"run {run_id} ({path})"), style="bold")
    # Eight columns fit 80 characters with these headings; the root causes, which are
    # as long as a worker made them, are listed under the table where they can wrap.
    table = Table(title="attempts", title_justify="left")
    for col in ("try", "ranks", "secs", "steps", "kept s", "lost s", "largest loss", "outcome"):
        table.add_column(col, overflow="fold")
    causes: list[tuple[int, str]] = []
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
            _fmt(sum(lost.values())),
            worst if lost[worst] > 0 else "",
            row["outcome"],
        )
        if row["cause"]:
            causes.append((row["attempt"], row["cause"]))
    console.print(table)
    for attempt, cause in causes:
        console.print(_cell(f"root cause of attempt {attempt}: {cause}"))
    for line in quarantine_lines(events):
        console.print(_cell(line))
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
        for col in ("try", "rank", "kind", "detail", "cost s", "redone"):
            faults.add_column(col, overflow="fold")
        for f in b.faults:
            faults.add_row(
                str(f.attempt),
                "" if f.rank is None else str(f.rank),
                _cell(f.kind),
                _cell(f.detail),
                _fmt(f.cost),
                str(f.steps_lost),
            )
        console.print(faults)
    last = events[-1] if events else {}
    if last.get("event") == Event.LAUNCHER_EXIT:
        console.print(_cell(f"launcher exit code: {last.get('exit_code')}"))


def report_main(argv: list[str]) -> int:
    """``stalwart report``; a reader that closes the pipe early (``| head``) ends it
    quietly, as it would end any other command-line tool."""
    try:
        code = _report(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would complain again flushing stdout at exit: point it at nothing.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    return code


def _report(argv: list[str]) -> int:
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
        from stalwart.reporting import timeline

        tl = timeline.build(run_events(chosen))
        try:
            if ns.html is not None:
                replace_file(ns.html, timeline.to_html(tl).encode(), mode=0o644)
            if ns.png is not None:
                draw = timeline.png_drawer(tl)  # before any file: no matplotlib, no file
                replace_file(ns.png, draw, mode=0o644)
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
    _print_run(console, chosen, run_events(chosen))
    return 0
