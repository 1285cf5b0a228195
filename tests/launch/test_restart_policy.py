"""--restart-policy all-failed: the launcher lets ranks leave a job that carries on in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import ROOT, events, kinds, stalwart, warm_and_cold

from .helpers import SCRIPTS

pytestmark = [pytest.mark.timeout(120), warm_and_cold]


def test_a_rank_leaving_does_not_stop_the_others(tmp_path: Path) -> None:
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "--restart-policy",
        "all-failed",
        "--inject",
        "exit:rank=1,step=2",
        "--log-dir",
        tmp_path / "l",
        SCRIPTS / "steps.py",
        tmp_path,
        "5",
    )
    assert proc.returncode == 0, proc.stderr
    assert "completed without rank(s) [1]" in proc.stderr
    assert len((tmp_path / "steps_0_0").read_text().split()) == 5  # rank 0 was not stopped
    evs = events(tmp_path / "l")
    assert "restart" not in kinds(evs) and kinds(evs)[-2:] == ["job_succeeded", "launcher_exit"]
    assert next(e for e in evs if e["event"] == "ranks_left")["ranks"] == [1]


def test_every_rank_failing_still_restarts(tmp_path: Path) -> None:
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "--restart-policy",
        "all-failed",
        "--max-restarts",
        "1",
        "--inject",
        "exit:rank=*,step=2,attempt=0",
        "--log-dir",
        tmp_path / "l",
        SCRIPTS / "steps.py",
        tmp_path,
        "5",
    )
    assert proc.returncode == 0, proc.stderr
    assert kinds(events(tmp_path / "l")).count("restart") == 1


def _clocks() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("stalwart-progress-*")} if shm.is_dir() else set()


def test_inprocess_job_continues_with_shifted_ranks_after_sigkill(tmp_path: Path) -> None:
    before = _clocks()
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "-r",
        "3",
        "--restart-policy",
        "all-failed",
        "--log-dir",
        tmp_path / "l",
        ROOT / "examples" / "inprocess_train.py",
        "--steps",
        "30",
        "--inject",
        "kill",
        "--inject-step",
        "10",
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out0 = next((tmp_path / "l").glob("*/attempt_0/0/stdout.log")).read_text()
    assert "[rank 0/1] resumed at step 10 (iteration 1)" in out0
    assert "finished 30 steps" in out0
    exits = {e["rank"]: e["signal"] for e in events(tmp_path / "l") if e["event"] == "worker_exit"}
    assert exits == {0: None, 1: "SIGKILL"}
    # The killed rank could not remove its progress clock; its monitor process did.
    assert _clocks() - before == set()
