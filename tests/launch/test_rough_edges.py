"""What a new user trips over first (issue 14): each case ran wrong before."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from stalwart.reporting.goodput import CATEGORIES
from tests.helpers import (
    ROOT,
    STALWART,
    clean_env,
    cold_only,
    events,
    kinds,
    run_dir,
    stalwart,
    start_stalwart,
    wait_for,
    warm_and_cold,
)

from .helpers import SCRIPTS

pytestmark = pytest.mark.timeout(90)


# Launcher-side output, whatever starts the worker: once, warm (the default).
def test_run_folder_printed_at_start_without_log_dir(tmp_path: Path) -> None:
    env = clean_env(TMPDIR=str(tmp_path))
    proc = stalwart("--nproc-per-node", "1", SCRIPTS / "steps.py", tmp_path, "2", env=env)
    assert proc.returncode == 0, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("stalwart: run folder "), proc.stderr
    folder = Path(first.removeprefix("stalwart: run folder "))
    assert folder.is_relative_to(tmp_path) and (folder / "events.jsonl").is_file()
    assert f"run folder: {folder}" in proc.stderr  # and again in the closing block


@warm_and_cold
def test_failure_summary_names_only_files_that_exist(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = stalwart(
        "--nproc-per-node", "1", "--log-dir", logs, "--inject", "crash:rank=0,step=1",
        SCRIPTS / "steps.py", tmp_path, "5",
    )  # fmt: skip
    assert proc.returncode == 1
    assert "root cause: rank 0" in proc.stderr
    for name in ("error.json", "stdout.log", "stderr.log"):
        assert name not in proc.stderr, proc.stderr
    proc = stalwart(
        "--nproc-per-node", "1", "--log-dir", tmp_path / "logs2", "-r", "3",
        "--inject", "crash:rank=0,step=1", SCRIPTS / "steps.py", tmp_path, "5",
    )  # fmt: skip
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("logs: "))
    paths = line.removeprefix("logs: ").split()
    assert [Path(p).name for p in paths] == ["stdout.log", "stderr.log"]
    assert all(Path(p).is_file() for p in paths)


@warm_and_cold
def test_ctrl_c_is_recorded_as_stopped_with_its_attempt(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = start_stalwart(
        "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs,
        SCRIPTS / "sleeper.py", tmp_path, "log",
    )  # fmt: skip
    wait_for(lambda: all((tmp_path / f"pids_{r}").exists() for r in (0, 1)), 30, "workers")
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT
    evs = events(logs)
    exits = [e for e in evs if e["event"] == "worker_exit"]
    assert len(exits) == 2 and {e["attempt"] for e in exits} == {0}
    stopped = [e for e in evs if e["event"] == "job_stopped"]
    assert len(stopped) == 1 and stopped[0]["attempt"] == 0
    assert stopped[0]["reason"] == "signal SIGINT"
    report = subprocess.run(
        [*STALWART, "report", "--json", logs], capture_output=True, text=True, cwd=ROOT, timeout=30
    )
    (run,) = json.loads(report.stdout)["runs"]
    assert run["outcome"] == "stopped"
    assert [a["outcome"] for a in run["attempts"]] == ["stopped"]


@warm_and_cold
def test_worker_exit_is_written_when_it_happens(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = stalwart(
        "--nproc-per-node", "2", "--shutdown-timeout", "2", "--log-dir", logs,
        "--inject", "crash:rank=0,step=3", SCRIPTS / "linger.py", tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    exits = {e["rank"]: e for e in events(logs) if e["event"] == "worker_exit"}
    crashed, lingered = exits[0], exits[1]
    assert crashed["signal"] == "SIGSEGV" and lingered["signal"] == "SIGKILL"
    # The crash is in the log long before the teardown (2 s of ignored SIGTERM) ends.
    assert crashed["time"] - crashed["exited_at"] < 0.5 * 2
    assert lingered["time"] - crashed["time"] > 1.5


@cold_only
def test_hung_ranks_stacks_go_to_their_folders_and_events(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = stalwart(
        "--nproc-per-node", "2", "--max-restarts", "1", "--hb-timeout", "1",
        "--hb-initial-timeout", "30", "--log-dir", logs, SCRIPTS / "hang_both.py",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    hangs = [e for e in events(logs) if e["event"] == "hang_detected"]
    # Both hang; the first one found ends the attempt, the other may be found with it.
    assert hangs and {h["global_rank"] for h in hangs} <= {0, 1}
    for h in hangs:
        assert "hang_both.py" in h["stacks"], h
        stacks = run_dir(logs) / "attempt_0" / str(h["local_rank"]) / "stacks.log"
        assert "hang_both.py" in stacks.read_text()
    # A rank that wrote no dump leaves no empty file behind (attempt 1 did not hang).
    assert not list((run_dir(logs) / "attempt_1").glob("*/stacks.log"))
    # Nothing of the dumps reached the shared console.
    assert "hang_both.py" not in proc.stderr and "most recent call first" not in proc.stderr


@warm_and_cold
def test_injected_fault_that_never_fired_is_recorded_and_reported(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = stalwart(
        "--nproc-per-node", "2", "--log-dir", logs, "--inject", "crash:rank=1,step=30",
        SCRIPTS / "envdump.py", tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--inject fault 'crash:rank=1,step=30' never fired" in proc.stderr
    evs = events(logs)
    assert evs[kinds(evs).index("launcher_start")]["inject"] == "crash:rank=1,step=30"
    assert evs[-1]["event"] == "launcher_exit"
    assert evs[-1]["inject_not_fired"] == ["crash:rank=1,step=30"]
    assert set(evs[-1]["goodput"]) == {*CATEGORIES, "ratio"}


# The report reads the event log, whatever started the workers: once, warm.
def test_report_lists_every_run_of_a_log_dir(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    for rid in ("first", "second"):
        proc = stalwart(
            "--nproc-per-node", "1", "--rdzv-id", rid, "--log-dir", logs,
            SCRIPTS / "steps.py", tmp_path, "2",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr

    def report(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*STALWART, "report", *args, str(logs)],
            capture_output=True, text=True, cwd=ROOT, timeout=30,
            env={**clean_env(), "COLUMNS": "200"},
        )  # fmt: skip

    out = report().stdout
    assert "2 runs" in out and "first" in out and "second *" in out
    assert "run second" in out
    assert "run first" in report("--run", "first").stdout
    bad = report("--run", "third")
    assert bad.returncode == 2 and "'third' is not a run" in bad.stderr
    data = json.loads(report("--json").stdout)
    assert [r["run_id"] for r in data["runs"]] == ["first", "second"]
    assert all(r["outcome"] == "succeeded" for r in data["runs"])


@cold_only
def test_survivors_get_the_survivor_grace_then_sigkill(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = stalwart(
        "--nproc-per-node", "3", "--max-restarts", "1", "--survivor-grace", "1.5",
        "--shutdown-timeout", "60", "--log-dir", logs, SCRIPTS / "survivors.py", tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    evs = events(logs)
    (stopping,) = [e for e in evs if e["event"] == "workers_stopping" and e["attempt"] == 0]
    assert stopping["reason"] == "local_failure" and stopping["grace"] == 1.5
    exits = {e["rank"]: e for e in evs if e["event"] == "worker_exit" and e["attempt"] == 0}
    # Rank 0 ignores SIGTERM: killed once the grace is over, not after --shutdown-timeout.
    assert exits[0]["signal"] == "SIGKILL"
    assert 1.4 < exits[0]["exited_at"] - stopping["time"] < 30
    # Rank 1's handler used its grace and ended the way it chose.
    assert exits[1]["exitcode"] == 0 and (tmp_path / "saved").read_text() == "done"
    assert exits[1]["exited_at"] - stopping["time"] >= 0.3
