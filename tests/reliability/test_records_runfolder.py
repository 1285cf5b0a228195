"""What the launcher reads back from and writes into its run folder, as a stranger (or an
accident) could leave it: tampered learned timeouts, links planted at the names of its
temporary files, a huge exception message, and a run folder reused by a later run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, STALWART, clean_env, cold_only, read_events, stalwart_argv

pytestmark = [pytest.mark.timeout(200), cold_only]

E2E_JOB = ROOT / "tests" / "monitor" / "e2e_job.py"
TIMED = ROOT / "tests" / "launch" / "scripts" / "timed_steps.py"
HUGE = Path(__file__).with_name("records_huge_message.py")


# Runs a command and reports the peak memory of its process tree on its last stderr
# line: this test process's own RUSAGE_CHILDREN holds the largest child of any earlier
# test in the session, so it cannot tell this run's peak.
_PEAK = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    "sys.stderr.write(f'\\nPEAK_KIB {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\\n'); "
    "sys.exit(r.returncode)"
)


def _run(
    logs: Path, run_id: str, *args: str | Path, timeout: float = 150, peak: bool = False
) -> subprocess.CompletedProcess[str]:
    argv = stalwart_argv("--nproc-per-node", "2", "--log-dir", logs, "--rdzv-id", run_id, *args)
    if peak:
        argv = [sys.executable, "-c", _PEAK, *map(str, argv)]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=clean_env(), cwd=ROOT,
    )  # fmt: skip


def _folder(logs: Path, run_id: str) -> Path:
    folder = logs / run_id
    folder.mkdir(parents=True, mode=0o700)
    return folder


# What a learned-timeouts file can hold that is not a learned timeout, and once stopped
# the launcher (a wrong type) or the hang check (infinity). Other malformed files (a
# list, NaN, bad UTF-8) were already ignored: the table in test_records_units has them.
TAMPERED = {
    "heartbeat a string": b'{"version": 1, "heartbeat": "x"}',
    "infinite": b'{"version": 1, "heartbeat": {"initial": Infinity, "subsequent": Infinity}}',
}


@pytest.mark.parametrize("content", TAMPERED.values(), ids=TAMPERED.keys())
def test_tampered_learned_timeouts_are_ignored_with_one_warning(
    content: bytes, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    folder = _folder(logs, "tampered")
    (folder / "learned_timeouts.json").write_bytes(content)
    proc = _run(
        logs, "tampered", "--hb-timeout", "auto", "--auto-warmup-steps", "3",
        "--hb-initial-timeout", "60", E2E_JOB, "healthy", "8", "0.05",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [ln for ln in proc.stderr.splitlines() if "learned timeouts" in ln]
    assert len(warned) == 1 and "learned_timeouts.json" in warned[0], proc.stderr[-3000:]
    evs = read_events(folder / "events.jsonl")
    assert not [e for e in evs if e["event"] == "hang_detected"]
    assert [p.name for p in folder.iterdir() if p.name.endswith(".tmp")] == []


def test_learned_timeouts_below_the_floor_are_raised_to_it(tmp_path: Path) -> None:
    # 0.001 s read back from the folder once killed a healthy rank: it is raised to the
    # floor (--auto-floor, here 5 s) with one warning, and the job runs through.
    logs = tmp_path / "logs"
    folder = _folder(logs, "floor")
    (folder / "learned_timeouts.json").write_text(
        json.dumps({"version": 1, "heartbeat": {"initial": 0.001, "subsequent": 0.001}})
    )
    proc = _run(
        logs, "floor", "--hb-timeout", "auto", "--auto-warmup-steps", "3", "--auto-floor", "5",
        "--hb-initial-timeout", "60", E2E_JOB, "healthy", "12", "0.05",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("below the floor of 5 s raised to it") == 1, proc.stderr[-3000:]
    evs = read_events(folder / "events.jsonl")
    assert not [e for e in evs if e["event"] == "hang_detected"]
    learned = [e for e in evs if e["event"] == "timeouts_learned"]
    assert learned and all(e["heartbeat"]["subsequent"] >= 5 for e in learned)
    assert (
        json.loads((folder / "learned_timeouts.json").read_text())["heartbeat"]["subsequent"] >= 5
    )


@pytest.mark.slow
def test_links_at_temporary_names_are_never_written_through(tmp_path: Path) -> None:
    # A hang makes the launcher learn timeouts and write a dossier: both once went
    # through a fixed `.tmp` name, so a link planted there overwrote its target.
    logs = tmp_path / "logs"
    folder = _folder(logs, "links")
    outside = tmp_path / "outside"
    outside.mkdir()
    targets = {}
    for name in ("learned_timeouts.json.tmp", "hang-dossier-attempt0.txt.tmp"):
        target = outside / f"victim-{name}"
        target.write_text("precious")
        (folder / name).symlink_to(target)
        targets[name] = target
    proc = _run(
        logs, "links", "--max-restarts", "1", "--hb-timeout", "auto",
        "--auto-warmup-steps", "3", "--hb-initial-timeout", "60",
        E2E_JOB, "sleep", "12", "0.3",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (folder / "learned_timeouts.json").is_file()
    assert (folder / "hang-dossier-attempt0.txt").is_file()
    for target in targets.values():
        assert target.read_text() == "precious"
    assert sorted(p.name for p in outside.iterdir()) == sorted(t.name for t in targets.values())


def test_a_five_megabyte_exception_message_restarts_normally(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = _run(logs, "huge", "--max-restarts", "1", HUGE, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evs = read_events(logs / "huge" / "events.jsonl")
    kinds = [e["event"] for e in evs]
    assert "restart" in kinds and kinds[-2:] == ["job_succeeded", "launcher_exit"], kinds
    cause = next(e for e in evs if e["event"] == "restart")["root_cause"]
    assert cause["rank"] == 1
    assert 0 < len(cause["message"]) <= 4096 and cause["message"].startswith("RuntimeError: ")
    assert len(cause["traceback"]) <= 16384 and "records_huge_message.py" in cause["traceback"]
    # The console line that says so stays one short line.
    line = next(ln for ln in proc.stderr.splitlines() if "attempt 0 failed" in ln)
    assert len(line) < 400, line
    # The terminal escape at the message's end is shown, not acted on.
    assert "\x1b" not in line and "\\x1b[2J end" in line, line
    assert max(len(json.dumps(e)) for e in evs) < 64 * 1024


def _old_runs(path: Path, runs: int, lines_per_run: int) -> None:
    """Events of earlier, hour-long runs of the same run id (as a reused folder has)."""
    t0 = time.time() - 86400
    with open(path, "w") as fh:
        for r in range(runs):
            start = t0 + r * 4000
            fh.write(
                json.dumps({"event": "launcher_start", "time": start, "run_id": "reused"}) + "\n"
            )
            fh.write(json.dumps({"event": "rendezvous_done", "time": start + 1, "attempt": 0,
                                 "world_size": 2, "run_id": "reused"}) + "\n")  # fmt: skip
            for i in range(lines_per_run):
                fh.write(json.dumps({
                    "event": "progress", "time": start + 2 + i * 3600 / lines_per_run,
                    "attempt": 0, "rank": 0, "local_rank": 0, "step": i, "pad": "x" * 120,
                }) + "\n")  # fmt: skip
            fh.write(
                json.dumps({"event": "job_succeeded", "time": start + 3600, "attempt": 0}) + "\n"
            )
            fh.write(
                json.dumps({"event": "launcher_exit", "time": start + 3601, "exit_code": 0}) + "\n"
            )


def test_a_reused_run_folder_is_accounted_per_run(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    folder = _folder(logs, "reused")
    _old_runs(folder / "events.jsonl", runs=3, lines_per_run=150_000)  # ≈ 90 MB
    assert (folder / "events.jsonl").stat().st_size > 80 << 20
    proc = _run(logs, "reused", TIMED, tmp_path, "10", "0.02", "5", peak=True)
    peak_mib = int(proc.stderr.rsplit("PEAK_KIB ", 1)[1].split()[0]) / 1024
    assert proc.returncode == 0, proc.stderr[-3000:]
    block = proc.stderr[proc.stderr.index("stalwart: job reused succeeded") :]
    # This run's few seconds, not three hours of earlier runs.
    assert " min" not in block.splitlines()[0] and "attempt(s) in" in block, block
    wall = float(block.splitlines()[0].split(" in ")[-1].split(" s")[0])
    assert wall < 60, block
    # Read as a stream: no process of the run grew anywhere near the file's size.
    assert peak_mib < 400, peak_mib
    exit_ev = read_events(folder / "events.jsonl")[-1]
    assert exit_ev["event"] == "launcher_exit"
    assert sum(v for k, v in exit_ev["goodput"].items() if k != "ratio") < 60
    report = subprocess.run(
        [*STALWART, "report", str(folder), "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=120, env=clean_env(),
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    shown = json.loads(report.stdout)["runs"][0]
    assert shown["breakdown"]["wall"] < 60 and len(shown["attempts"]) == 1
    assert os.path.getsize(folder / "events.jsonl") > 80 << 20
