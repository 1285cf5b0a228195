"""Per-attempt log folders, fd-level redirect, tee with prefixes, the local-ranks filter."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import SCRIPTS, events, run_dir, stalwart

pytestmark = pytest.mark.timeout(60)


def test_redirect_captures_python_fd_and_child_output(tmp_path: Path) -> None:
    proc = stalwart(
        "--nproc-per-node", "2", "-r", "3", "--log-dir", tmp_path, SCRIPTS / "output.py"
    )
    assert proc.returncode == 0, proc.stderr
    d = run_dir(tmp_path) / "attempt_0"
    out1 = (d / "1" / "stdout.log").read_text()
    assert "py-out rank=1" in out1 and "fd-out rank=1" in out1 and "c-out rank=1" in out1
    assert (d / "1" / "stderr.log").read_text() == "py-err rank=1\n"
    assert "py-out" not in proc.stdout  # redirected, not tee'd


def test_tee_prefixes_filter_and_crash_mid_line(tmp_path: Path) -> None:
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "-t",
        "3",
        "--local-ranks-filter",
        "1",
        "--log-line-prefix-template",
        "<${role_name}:${rank}> ",
        "--log-dir",
        tmp_path,
        SCRIPTS / "output.py",
        "die-mid-line",
    )
    assert proc.returncode == 1
    assert "<default:1> py-out rank=1" in proc.stdout
    assert "<default:1> unterminated rank=1" in proc.stdout  # the partial last line survives
    assert "rank=0" not in proc.stdout  # filtered from the console ...
    d = run_dir(tmp_path) / "attempt_0"
    assert "unterminated rank=0" in (d / "0" / "stdout.log").read_text()  # ... but in its file


def test_default_prefix_is_global_rank(tmp_path: Path) -> None:
    proc = stalwart(
        "--nproc-per-node", "2", "-t", "1", "--log-dir", tmp_path, SCRIPTS / "output.py"
    )
    assert proc.returncode == 0, proc.stderr
    assert "[0]:py-out rank=0" in proc.stdout and "[1]:fd-out rank=1" in proc.stdout
    evs = events(tmp_path)
    ipc = next(e for e in evs if e["event"] == "monitor_started")["run_dir"]
    assert not Path(ipc).exists()  # nothing left in /tmp after a normal run


def test_attempt_folders_per_restart(tmp_path: Path) -> None:
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "-r",
        "3",
        "--max-restarts",
        "1",
        "--log-dir",
        tmp_path,
        SCRIPTS / "output.py",
        "die-mid-line",
    )
    assert proc.returncode == 1
    rd = run_dir(tmp_path)
    for attempt in (0, 1):
        for lr in (0, 1):
            assert (rd / f"attempt_{attempt}" / str(lr) / "stdout.log").is_file()
