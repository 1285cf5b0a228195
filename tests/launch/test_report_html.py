"""`stalwart report --html/--png` of a real run with a crash and a restart."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT, STALWART, clean_env, cold_only, stalwart

from .helpers import SCRIPTS

pytestmark = [
    pytest.mark.timeout(120),
    cold_only,
]


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run for every test here (they only read it)."""
    out = tmp_path_factory.mktemp("crashed")
    logs = out / "logs"
    proc = stalwart(
        "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs,
        "--inject", "crash:rank=1,step=12", SCRIPTS / "timed_steps.py", out, "25", "0.02", "5",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return logs


def report(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*STALWART, "report", *map(str, args)],
        capture_output=True, text=True, cwd=ROOT, timeout=60, env=clean_env(),
    )  # fmt: skip


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no headless chromium (apt-get install chromium)")
def test_html_loads_in_chromium_and_shows_the_attempts(crashed_run: Path, tmp_path: Path) -> None:
    page = tmp_path / "run.html"
    proc = report(crashed_run, "--html", page)
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in text and "<script" not in text  # self-contained
    assert CHROMIUM is not None
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    # As the browser parsed it: the timeline of both attempts, the fault and the breakdown.
    assert '<svg id="timeline"' in dom
    assert 'class="seg running" data-attempt="0" data-rank="0"' in dom
    assert 'class="seg running" data-attempt="1" data-rank="1"' in dom
    assert 'class="seg restart" data-attempt="0"' in dom
    assert 'class="mark fault" data-attempt="0"' in dom
    assert 'class="mark checkpoint"' in dom
    assert "attempt 0 (failed)" in dom and "attempt 1 (succeeded)" in dom
    assert dom.count('class="cat"') == 8
    assert "rank 1 crash (signal SIGSEGV)" in dom


def test_png_is_written(crashed_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--png needs the report extra")
    image = tmp_path / "run.png"
    proc = report(crashed_run, "--png", image)
    assert proc.returncode == 0, proc.stderr
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_the_report_counts_the_launchers_own_start_up(crashed_run: Path) -> None:
    """The run's wall starts when the launcher's process did, before its first record."""
    (events,) = crashed_run.glob("*/events.jsonl")
    recs = [json.loads(line) for line in events.read_text().splitlines()]
    start = next(e for e in recs if e["event"] == "launcher_start")
    first = min(e["time"] for e in recs)
    assert start["time"] - 60 < start["process_start"] < first <= start["time"]
    proc = report(crashed_run, "--json")
    assert proc.returncode == 0, proc.stderr
    (run,) = json.loads(proc.stdout)["runs"]
    assert run["breakdown"]["start"] == start["process_start"]


def test_unwritable_target_is_one_line(crashed_run: Path, tmp_path: Path) -> None:
    proc = report(crashed_run, "--html", tmp_path / "missing" / "run.html")
    assert proc.returncode == 2
    assert proc.stderr.startswith("stalwart report: error: ") and proc.stderr.count("\n") == 1


def test_hang_is_drawn_with_its_stacks() -> None:
    from stalwart.reporting import timeline

    def ev(event: str, t: float, **f: object) -> dict[str, object]:
        return {"event": event, "time": t, **f}

    events = [
        ev("launcher_start", 0.0, run_id="h"),
        ev("worker_spawn", 1.0, attempt=0, rank=0),
        ev("worker_spawn", 1.0, attempt=0, rank=1),
        ev("progress", 2.0, attempt=0, rank=0, step=0, step_time=2.0),
        ev("progress", 2.0, attempt=0, rank=1, step=0, step_time=2.0),
        ev("hang_detected", 11.0, attempt=0, global_rank=1, kind="heartbeat",
           last_heartbeat_age=3.0, stacks='File "train.py", line 9 in <step & wait>'),
        ev("worker_exit", 11.3, attempt=0, rank=1, exitcode=-15, exited_at=11.2),
        ev("worker_exit", 11.4, attempt=0, rank=0, exitcode=-15, exited_at=11.4),
        ev("job_failed", 12.0, attempt=0,
           root_cause={"rank": 1, "signal": "SIGTERM", "exitcode": -15, "timestamp": 11.0}),
        ev("launcher_exit", 12.5),
    ]  # fmt: skip
    tl = timeline.build(events)  # type: ignore[arg-type]
    kinds = {(s.rank, s.kind): (s.start, s.end) for s in tl.segments}
    assert kinds[(1, "hang")] == (8.0, 11.0)  # last heartbeat 3 s before the detection
    assert kinds[(1, "running")] == (2.0, 8.0)
    assert kinds[(1, "teardown")] == (11.0, 11.2)
    assert kinds[(0, "running")] == (2.0, 11.0) and kinds[(0, "teardown")] == (11.0, 11.4)
    page = timeline.to_html(tl)
    assert '<details class="stacks"><summary>attempt 0, rank 1' in page
    assert "in &lt;step &amp; wait&gt;" in page  # escaped, never raw HTML
