"""The run folder under a log root others can write to: links are refused, never followed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.helpers import stalwart

from .helpers import SCRIPTS


def one_line_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_planted_events_link_fails_in_one_line(tmp_path: Path) -> None:
    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    run = tmp_path / "logs" / "job1"
    run.mkdir(parents=True, mode=0o700)
    (run / "events.jsonl").symlink_to(target)
    res = stalwart(
        "--log-dir", tmp_path / "logs", "--rdzv-id", "job1", SCRIPTS / "output.py", timeout=60
    )
    assert res.returncode == 2
    line = one_line_error(res.stderr)
    assert "events.jsonl" in line and "symbolic link" in line, line
    assert target.read_text() == "precious\n"


def test_planted_run_folder_link_fails_in_one_line(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "job2").symlink_to(elsewhere)
    res = stalwart(
        "--log-dir", tmp_path / "logs", "--rdzv-id", "job2", SCRIPTS / "output.py", timeout=60
    )
    assert res.returncode == 2
    assert "symbolic link" in one_line_error(res.stderr)
    assert list(elsewhere.iterdir()) == []


def test_run_id_with_a_slash_is_refused(tmp_path: Path) -> None:
    res = stalwart(
        "--log-dir", tmp_path / "logs", "--rdzv-id", "a/b", SCRIPTS / "output.py", timeout=60
    )
    assert res.returncode == 2
    assert "--rdzv-id 'a/b'" in one_line_error(res.stderr)
    assert not (tmp_path / "logs" / "a").exists()


def test_run_folder_is_private_and_reopened(tmp_path: Path) -> None:
    from stalwart.launch.files.runfiles import make_run_dir, open_append

    run = tmp_path / "job"
    run.mkdir(mode=0o777)
    os.chmod(run, 0o777)  # an earlier run's folder, made under a loose umask
    assert make_run_dir(tmp_path, "job") == run
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    fresh = make_run_dir(tmp_path, "fresh")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    os.close(open_append(fresh / "events.jsonl"))
    assert stat.S_IMODE((fresh / "events.jsonl").stat().st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder of another user")
def test_run_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    from stalwart.launch.files.runfiles import RunFolderError, make_run_dir

    run = tmp_path / "job"
    run.mkdir(mode=0o700)
    os.chown(run, 12345, 12345)
    with pytest.raises(RunFolderError, match="belongs to uid 12345"):
        make_run_dir(tmp_path, "job")
