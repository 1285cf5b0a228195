"""The user's check command: real processes, bounded in time and output, no orphan."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from stalwart.health.records import PROBLEM_LIMIT
from stalwart.health.usercheck import run_user_check
from tests.helpers import alive, wait_for

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("cmd", "want"),
    [
        ("true", None),
        ("exit 0", None),
        ('echo \'{"reason": "GPU 3 clock low"}\'; exit 2', "exited 2: GPU 3 clock low"),
        ("echo 'not json at all'; exit 1", "exited 1: not json at all"),
        ("echo '{\"reason\": 5}'; exit 1", 'exited 1: {"reason": 5}'),
        ("exit 9", "exited 9"),
        ("kill -KILL $$", "was killed by SIGKILL"),
        ("/nonexistent/check", "exited 127"),
    ],
)
def test_exit_status_and_reason(cmd: str, want: str | None) -> None:
    got = run_user_check(cmd, 10)
    if want is None:
        assert got is None
    else:
        assert got is not None and want in got and "\n" not in got


def test_a_flood_of_output_is_read_bounded() -> None:
    # 200 MB on one line: read up to the limit, the rest drained, one bounded line back.
    t0 = time.monotonic()
    got = run_user_check("head -c 200000000 /dev/zero | tr '\\0' x; exit 3", 20)
    assert got is not None and "exited 3" in got and len(got) <= PROBLEM_LIMIT
    assert time.monotonic() - t0 < 20


def test_a_hung_check_and_its_children_are_killed_at_the_timeout(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    # A child in the background that keeps stdout open, and the check itself asleep.
    cmd = f"sleep 300 & echo $! > {pids}; echo $$ >> {pids}; sleep 300"
    t0 = time.monotonic()
    got = run_user_check(cmd, 1.0)
    took = time.monotonic() - t0
    assert got is not None and "did not finish within 1s (killed)" in got
    assert took < 10
    for pid in map(int, pids.read_text().split()):
        wait_for(lambda p=pid: not alive(p), 5, f"check process {pid} to be gone")


def test_a_check_that_exits_leaving_a_child_holding_stdout() -> None:
    # The shell exits 0 at once; its child keeps the pipe open past the timeout.
    t0 = time.monotonic()
    got = run_user_check("sleep 300 & exit 0", 1.0)
    assert got is not None and "killed" in got
    assert time.monotonic() - t0 < 10


def test_the_check_gets_no_stdin_and_cannot_block_on_it() -> None:
    assert run_user_check('read line; test -z "$line"', 5) is None


def test_the_command_line_in_the_reason_is_cut() -> None:
    long = "exit 1 #" + "y" * 500
    got = run_user_check(long, 5)
    assert got is not None and "..." in got and len(got) < 200
