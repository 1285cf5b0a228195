"""A worker's death is acted on at once, however it died; a hang report that comes
after the teardown began still explains the failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.launch.round.hangs import annotate
from stalwart.monitor import HangKind, HangReport
from stalwart.rendezvous.api import WorkerFailed
from tests.helpers import events, stalwart, warm_and_cold

from .helpers import SCRIPTS

pytestmark = pytest.mark.timeout(90)

INTERVAL = 0.5  # --monitor-interval; the old code waited 1.0 s for a report on signal deaths


@warm_and_cold
@pytest.mark.parametrize("spec", ["sigkill:rank=1,step=3", "exit:rank=1,step=3,code=4"])
def test_teardown_starts_within_one_monitor_interval(tmp_path: Path, spec: str) -> None:
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        str(INTERVAL),
        "--inject",
        spec,
        "--log-dir",
        tmp_path / "l",
        SCRIPTS / "paced.py",
        tmp_path,
        "2000",
        "0.02",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    evs = events(tmp_path / "l")
    (died,) = [e for e in evs if e["event"] == "worker_exit" and e["rank"] == 1]
    (stopping,) = [e for e in evs if e["event"] == "workers_stopping"]
    assert stopping["reason"] == "local_failure"
    latency = stopping["time"] - died["exited_at"]
    assert 0 <= latency < INTERVAL, latency


@warm_and_cold
def test_late_hang_report_still_explains_the_failure(tmp_path: Path) -> None:
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "--hb-timeout",
        "1",
        "--hb-initial-timeout",
        "60",
        "--stack-dump-wait",
        "20",
        "--log-dir",
        tmp_path / "l",
        SCRIPTS / "paced.py",
        tmp_path,
        "3000",
        "0.02",
        "hang-then-exit",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    evs = events(tmp_path / "l")
    (died,) = [e for e in evs if e["event"] == "worker_exit" and e["rank"] == 1]
    assert died["exitcode"] == 7
    (hang,) = [e for e in evs if e["event"] == "hang_detected"]
    (stopping,) = [e for e in evs if e["event"] == "workers_stopping"]
    # The report was filed after the teardown began (the monitor was still waiting for
    # stacks), so only a late look can have found it.
    assert hang["time"] > stopping["time"]
    (failed,) = [e for e in evs if e["event"] == "job_failed"]
    assert failed["root_cause"]["rank"] == 1
    assert failed["root_cause"]["reason"].startswith("hang detected: heartbeat timeout 1s")
    assert "hang detected: heartbeat timeout 1s" in proc.stderr


def _hang(**kw: object) -> HangReport:
    base: dict[str, object] = dict(
        local_rank=1,
        global_rank=1,
        pid=42,
        kind=HangKind.HEARTBEAT,
        section=None,
        timeout=2.0,
        last_heartbeat_age=None,
        iteration=None,
        stacks="",
        detected_at=100.0,
    )
    base.update(kw)
    return HangReport(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("hang", "failure_ts", "failure_tb", "expected"),
    [
        (_hang(), 105.0, "", ("hang detected: heartbeat timeout 2s", 100.0, "")),
        (
            _hang(kind=HangKind.SECTION, section="step", last_heartbeat_age=3.04, iteration=7),
            105.0,
            "",
            (
                "hang detected: section timeout 2s, section 'step', last heartbeat 3.0s ago,"
                " iteration 7",
                100.0,
                "",
            ),
        ),
        # The worker's own traceback wins over the monitor's stacks; an earlier exit
        # time is kept.
        (
            _hang(stacks="File x"),
            99.0,
            "Traceback",
            ("hang detected: heartbeat timeout 2s", 99.0, "Traceback"),
        ),
        (
            _hang(stacks="File x"),
            105.0,
            "",
            ("hang detected: heartbeat timeout 2s", 100.0, "File x"),
        ),
    ],
)
def test_annotate(
    hang: HangReport, failure_ts: float, failure_tb: str, expected: tuple[str, float, str]
) -> None:
    failure = WorkerFailed(
        node_rank=0, local_rank=1, pid=42, exitcode=-15, timestamp=failure_ts, traceback=failure_tb
    )
    assert annotate(failure, hang) == expected
