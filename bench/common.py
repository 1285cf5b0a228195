"""Shared benchmark plumbing: medians, the machine line, rich tables and markdown."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table


def machine() -> str:
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {mem:.0f} GiB, "
        f"{platform.platform()}, Python {platform.python_version()}, torch {torch.__version__}"
    )


def med(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def fmt(x: float | None, unit: str = "s", digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f} {unit}".strip()


def spread(xs: Sequence[float], unit: str = "s", digits: int = 2) -> str:
    if not xs:
        return "n/a"
    return (
        f"{min(xs):.{digits}f} / {statistics.median(xs):.{digits}f} / {max(xs):.{digits}f} {unit}"
    )


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b in (None, 0) else f"{a / b:.2f}x"


def show(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> None:
    if markdown:
        print(f"\n### {title}\n")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print()
        return
    table = Table(title=title)
    for h in header:
        table.add_column(h)
    for row in rows:
        table.add_row(*row)
    Console(file=sys.stdout).print(table)


def kill_leftovers(work: object) -> int:
    """Kills processes whose command line names this run's private folder: a launcher
    killed at its deadline may leave workers behind (torchrun's survive its SIGKILL),
    and they would load the machine for the runs after it."""
    import psutil

    needle = str(work)
    killed = 0
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(needle in arg for arg in proc.info["cmdline"] or []):
                proc.kill()
                killed += 1
        except psutil.Error:
            continue
    return killed


def run_job(
    cmd: list[str], extra_env: dict[str, str], work: object, deadline: float
) -> tuple[int | None, list[dict[str, object]]]:
    """Runs one launcher command in its own session with a clean stalwart/torchelastic
    environment plus *extra_env*; kills it (and its leftovers) at *deadline*. Returns its
    exit code (None when killed) and rank 0's per-step records from work/p.jsonl."""
    import json
    import signal
    import subprocess
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "TORCHELASTIC_"))}
    env.update(extra_env)
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=str(work),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        code: int | None = proc.wait(deadline)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kill_leftovers(work)
        code = None
    progress = Path(str(work)) / "p.jsonl"
    recs = [json.loads(x) for x in progress.read_text().splitlines()] if progress.exists() else []
    return code, recs
