"""``stalwart report RUN_DIR``: what happened in a run, read back from ``events.jsonl``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from stalwart.launch.events import read_events


def _find_events(path: Path) -> Path:
    if path.is_file():
        return path
    direct = path / "events.jsonl"
    if direct.is_file():
        return direct
    found = sorted(path.glob("*/events.jsonl"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no events.jsonl under {path}")
    return found[-1]


def summarise(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per attempt: start, end, outcome, root cause."""
    rows: dict[int, dict[str, Any]] = {}
    for ev in events:
        attempt = ev.get("attempt")
        if not isinstance(attempt, int) or attempt < 0:
            continue
        row = rows.setdefault(attempt, {"attempt": attempt, "outcome": "running", "cause": ""})
        kind = ev["event"]
        if kind == "rendezvous_done":
            row["start"] = ev["time"]
            row["world_size"] = ev.get("world_size")
        elif kind == "worker_exit":
            row["end"] = max(row.get("end", 0.0), ev.get("exited_at") or ev["time"])
        elif kind in ("restart", "job_failed"):
            row["outcome"] = "failed"
            cause = ev.get("root_cause") or {}
            if cause:
                how = (
                    f"signal {cause['signal']}"
                    if cause.get("signal")
                    else f"exit {cause.get('exitcode')}"
                )
                why = cause.get("reason") or cause.get("message") or ""
                row["cause"] = f"rank {cause.get('rank')} {how} {why}".strip()
        elif kind == "job_succeeded":
            row["outcome"] = "succeeded"
    return [rows[k] for k in sorted(rows)]


def report_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="stalwart report")
    parser.add_argument("path", type=Path, help="run folder, log dir, or events.jsonl")
    ns = parser.parse_args(argv)
    try:
        path = _find_events(ns.path)
    except FileNotFoundError as err:
        print(f"stalwart report: error: {err}", file=sys.stderr)
        return 2
    events = list(read_events(path))
    console = Console()
    table = Table(title=f"run {events[0].get('run_id') if events else '?'} ({path})")
    for col in ("attempt", "world size", "duration s", "outcome", "root cause"):
        table.add_column(col)
    for row in summarise(events):
        dur = row["end"] - row["start"] if "start" in row and "end" in row else None
        table.add_row(
            str(row["attempt"]),
            str(row.get("world_size", "")),
            f"{dur:.2f}" if dur is not None else "",
            row["outcome"],
            row["cause"],
        )
    console.print(table)
    last = events[-1] if events else {}
    if last.get("event") == "launcher_exit":
        console.print(f"launcher exit code: {last.get('exit_code')}")
    return 0
