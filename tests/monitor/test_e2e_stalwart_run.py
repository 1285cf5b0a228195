"""End to end: `stalwart run` with a rank that hangs; the monitor reports it, the job
restarts and finishes. Reads the run's events.jsonl."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, clean_env, read_events, stalwart_argv

JOB = Path(__file__).with_name("e2e_job.py")


def run_job(
    tmp_path: Path, mode: str, *flags: str, pause: float = 0.02
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    logs = tmp_path / "logs"
    proc = subprocess.run(
        stalwart_argv("--nproc-per-node", "2",
         "--max-restarts", "2", "--rdzv-id", f"e2e-{mode}", "--log-dir", logs,
         "--hb-initial-timeout", "60", *flags, JOB, mode, "12", str(pause)),
        capture_output=True, text=True, timeout=150, env=clean_env(), cwd=ROOT,
    )  # fmt: skip
    events_file = logs / f"e2e-{mode}" / "events.jsonl"
    assert events_file.exists(), proc.stderr[-3000:]
    return proc, read_events(events_file)


def check(
    proc: subprocess.CompletedProcess[str], events: list[dict[str, Any]], kind: str
) -> dict[str, Any]:
    names = [e["event"] for e in events]
    assert proc.returncode == 0, (names, proc.stderr[-3000:])
    hangs = [e for e in events if e["event"] == "hang_detected"]
    mine = [h for h in hangs if h["global_rank"] == 1]
    assert mine, (names, proc.stderr[-3000:])
    assert mine[0]["kind"] == kind and mine[0]["attempt"] == 0
    assert names.index("hang_detected") < names.index("restart") < names.index("job_succeeded")
    return mine[0]


@pytest.mark.slow
@pytest.mark.timeout(160)
def test_sleeping_rank_is_restarted(tmp_path: Path) -> None:
    proc, events = run_job(tmp_path, "sleep", "--hb-timeout", "2", "--redirects", "3")
    hang = check(proc, events, "heartbeat")
    assert hang["iteration"] == 4 and hang["timeout"] == 2
    assert "e2e_job.py" in hang["stacks"]


@pytest.mark.slow
@pytest.mark.timeout(160)
def test_sigstopped_rank_is_restarted(tmp_path: Path) -> None:
    proc, events = run_job(tmp_path, "sigstop", "--hb-timeout", "2")
    check(proc, events, "heartbeat")


@pytest.mark.slow
@pytest.mark.timeout(160)
def test_section_timeout_restarts(tmp_path: Path) -> None:
    proc, events = run_job(tmp_path, "section", "--section-timeout", "step=2")
    hang = check(proc, events, "section")
    assert hang["section"] == "step"


@pytest.mark.slow
@pytest.mark.timeout(160)
def test_expired_timer_restarts(tmp_path: Path) -> None:
    # No heartbeat timeout at all: only the rank's own timer catches the hang.
    proc, events = run_job(tmp_path, "timer")
    hang = check(proc, events, "timer")
    assert hang["section"] == "stuck_step"


@pytest.mark.slow
@pytest.mark.timeout(160)
def test_shutdown_request_stops_the_job_without_restart(tmp_path: Path) -> None:
    proc, events = run_job(tmp_path, "shutdown")
    names = [e["event"] for e in events]
    assert proc.returncode != 0, names
    (req,) = [e for e in events if e["event"] == "control_request"]
    assert req["action"] == "shutdown_workload" and req["rank"] == 1
    assert "job_stopped" in names and "restart" not in names


@pytest.mark.slow
@pytest.mark.timeout(160)
def test_rank_waited_on_is_the_root_cause(tmp_path: Path) -> None:
    # Without sections, both ranks' heartbeats go stale a step apart; the summary and the
    # restart event must name the sleeping rank 1, not rank 0 blocked in a collective.
    proc, events = run_job(
        tmp_path, "peer_sleeps", "--hb-timeout", "1", "--monitor-interval", "0.1"
    )
    hang = check(proc, events, "heartbeat")
    assert hang["waiting_on"] is None and hang["iteration"] == 4
    for other in (e for e in events if e["event"] == "hang_detected" and e["global_rank"] == 0):
        assert other["waiting_on"] == 1 and other["iteration"] == 5
    (restart,) = [e for e in events if e["event"] == "restart"]
    assert restart["root_cause"]["rank"] == 1, restart
    # the summary's reason points at the dossier, which holds both ranks
    dossier = tmp_path / "logs" / "e2e-peer_sleeps" / "hang-dossier-attempt0.txt"
    assert str(dossier) in restart["root_cause"]["reason"]
    text = dossier.read_text()
    assert "== rank 0 " in text and "== rank 1 " in text


@pytest.mark.slow
@pytest.mark.timeout(160)
def test_auto_timeout_learned_and_kept_in_the_run_folder(tmp_path: Path) -> None:
    # No number given: the hang of rank 1 at step 5 is caught by a learned timeout far
    # below the 60 s that applies before warm-up, and the value is kept in the run folder.
    # Steps a few scans long: a scan sees each beat, so warm-up has gaps to learn from
    # (steps faster than the scan could all fall between two reads on a loaded machine).
    proc, events = run_job(
        tmp_path, "sleep", "--hb-timeout", "auto", "--auto-warmup-steps", "3", pause=0.3
    )
    hang = check(proc, events, "heartbeat")
    before = events[: events.index(hang)]
    learned = [e for e in before if e["event"] == "timeouts_learned"]
    assert learned and hang["timeout"] == learned[-1]["heartbeat"]["subsequent"] < 10
    kept = json.loads((tmp_path / "logs" / "e2e-sleep" / "learned_timeouts.json").read_text())
    assert kept["heartbeat"]["subsequent"] >= hang["timeout"]
