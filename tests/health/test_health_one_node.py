"""A job of one node: its health check runs before every attempt; a failing one stops
the job with one line and a nonzero exit before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import events, kinds, stalwart

pytestmark = pytest.mark.timeout(120)


def test_a_failing_check_stops_a_one_node_job_before_its_workers(tmp_path: Path) -> None:
    # A script without a __main__ guard: any run of it leaves the marker.
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('1')\n")
    check = 'echo \'{"reason": "GPU 3 clock low"}\'; exit 4'
    res = stalwart(
        "--log-dir", tmp_path / "logs", "--node-health-check", check, script
    )  # fmt: skip
    assert res.returncode == 3, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines == [
        "stalwart run: error: this node failed its health check before attempt 0: health "
        f"check `{check}` exited 4: GPU 3 clock low"
    ], res.stderr[-2000:]
    assert not (tmp_path / "ran").exists()
    evs = events(tmp_path / "logs")
    assert "worker_spawn" not in kinds(evs)
    (ex,) = [e for e in evs if e["event"] == "node_excluded"]
    assert ex["reasons"] == [f"health check `{check}` exited 4: GPU 3 clock low"]
    assert ex["this_node"] is True and ex["by"] == "health_check"


def test_a_passing_check_runs_before_every_attempt_of_a_program_without_stalwart(
    tmp_path: Path,
) -> None:
    # The job is a shell, which never imports stalwart; it fails once, then succeeds.
    count = tmp_path / "checks"
    res = stalwart(
        "--log-dir", tmp_path / "logs", "--max-restarts", "1", "--no-python",
        "--node-health-check", f"echo x >> {count}",
        "/bin/sh", "-c", f"test -e {tmp_path}/again || {{ touch {tmp_path}/again; exit 1; }}",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert count.read_text().count("x") == 2  # attempt 0 and attempt 1
    evs = events(tmp_path / "logs")
    checked = [e for e in evs if e["event"] == "health_checked"]
    assert [e["attempt"] for e in checked] == [0, 1] and checked[0]["problems"] == []
    assert "node_excluded" not in kinds(evs)
