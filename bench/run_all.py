"""Runs every benchmark, each side by side with its anchor, and rewrites docs/benchmarks.md.

    .venv/bin/pip install -q -c constraints.txt -r bench/requirements.txt
    .venv/bin/python bench/run_all.py [--quick] [--only launch,checkpoint]

Benchmarks run one after another (never in parallel: they time a shared 2-core machine),
each printing markdown tables; the file gets them all under the date and machine line.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from common import machine  # noqa: E402

# name -> (script, extra args for a full run, extra args for --quick)
BENCHES = {
    "launch": ("bench_launch.py", ["--repeats", "5"], ["--repeats", "2"]),
    "checkpoint": ("bench_checkpoint.py", [], ["--size-mib", "256", "--repeats", "2"]),
    "monitor": ("bench_monitor.py", [], ["--quick"]),
    "hang": ("bench_hang.py", [], ["--repeats", "1", "--idle-cap", "20"]),
    "inprocess": ("bench_inprocess.py", [], ["--repeats", "2"]),
    "multinode": ("bench_multinode.py", ["--repeats", "3"], ["--repeats", "1", "--nodes", "2,4"]),
    "frameworks": ("bench_frameworks.py", ["--repeats", "3"], ["--repeats", "1"]),
    "goodput": ("bench_goodput.py", ["--repeats", "3"], ["--repeats", "1", "--steps", "200"]),
    "launcher_exit": ("bench_launcher_exit.py", ["--repeats", "5"], ["--repeats", "2"]),
    "dcp": ("bench_dcp.py", ["--repeats", "3"], ["--mib", "64", "--repeats", "1"]),
    "restart_costs": ("bench_warmwriter.py", ["--repeats", "3"], ["--repeats", "1"]),
    "health": ("bench_health.py", ["--repeats", "2"], ["--repeats", "1", "--nodes", "2,4"]),
    "quarantine": ("bench_quarantine.py", ["--repeats", "3"], ["--repeats", "1"]),
    "health_goodput": (
        "bench_health_goodput.py",
        ["--repeats", "3", "--steps", "600"],
        ["--repeats", "1", "--steps", "150"],
    ),
}


_PROGRESS = re.compile(r"^(\[\d+/\d+\]|round \d+/\d+ done)")


def keep_report(stdout: str, markdown: bool) -> str:
    """The report part of a bench's output: markdown tables, headings, bullets and the
    machine/goal lines when it prints markdown; its plain tables otherwise. Progress
    lines and the console copies of tables are left out of the docs."""
    lines: list[str] = []
    for line in stdout.splitlines():
        if _PROGRESS.match(line) or (line.strip() and line in lines):
            continue
        if markdown and not (
            line.startswith(("|", "#", "- ", "machine:", "Goal"))
            or " · " in line
            or not line.strip()
        ):
            continue
        lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller sizes")
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(BENCHES))
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ns = ap.parse_args()
    chosen = [b for b in ns.only.split(",") if b] or list(BENCHES)
    unknown = sorted(set(chosen) - set(BENCHES))
    if unknown:
        print(
            f"run_all: unknown benchmark(s) {unknown}; expected {sorted(BENCHES)}", file=sys.stderr
        )
        return 2
    sections = []
    failed = []
    for name in chosen:
        script, full, quick = BENCHES[name]
        path = HERE / script
        if not path.exists():
            failed.append(f"{name}: {script} missing")
            continue
        helptext = subprocess.run(
            [sys.executable, str(path), "--help"], capture_output=True, text=True
        ).stdout
        markdown = "--markdown" in helptext
        cmd = [sys.executable, str(path), *(quick if ns.quick else full)]
        if markdown:
            cmd.append("--markdown")
        print(f"== {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        # Wide enough that rich tables of benches without --markdown stay on one line.
        env = {**os.environ, "COLUMNS": "200"}
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
        took = time.monotonic() - t0
        print(proc.stdout)
        if proc.returncode != 0:
            failed.append(f"{name}: exit {proc.returncode}")
        report = keep_report(proc.stdout, markdown)
        body = report if markdown else f"```\n{report}\n```"
        sections.append(
            f"## {name}\n\n`python bench/{script} {' '.join(quick if ns.quick else full)}` "
            f"({took:.0f} s)\n\n{body}\n"
        )
    header = (
        "# Benchmarks\n\n"
        f"Latest run: {machine()}{' (quick mode)' if ns.quick else ''}.\n"
        "Regenerate with `python bench/run_all.py` (after "
        "`pip install -c constraints.txt -r bench/requirements.txt`). The machine is shared "
        "and noisy: each benchmark interleaves the anchor and stalwart in one run and "
        "reports medians.\n"
    )
    if ns.only:
        print("--only given: docs/benchmarks.md left unchanged", file=sys.stderr)
    else:
        ns.out.write_text(header + "\n" + "\n".join(sections))
        print(f"wrote {ns.out}", file=sys.stderr)
    for f in failed:
        print(f"run_all: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
