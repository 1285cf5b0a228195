"""A worker's death is acted on at once, however it died; a hang report that comes
after the teardown began still explains the failure."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from stalwart.launch.round.hangs import annotate
from stalwart.monitor import HangKind, HangReport
from stalwart.rendezvous.api import WorkerFailed
from tests.helpers import alive, clean_env, events, stalwart, wait_for, warm_and_cold

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


def test_a_death_is_not_kept_waiting_on_the_stray_scan(tmp_path: Path) -> None:
    """The round's periodic stray scan (a pass over the whole process table, every 0.5 s
    without a job cgroup) no longer runs between a death and the survivors' stop: the
    teardown kills strays itself.  The worker dies after the scan is due and the loop
    sleeps long (--monitor-interval 5), so its death is the wake-up that used to scan
    first; the daemon it left behind still dies with the attempt."""
    pid_file = tmp_path / "daemon"
    script = tmp_path / "leave_daemon_then_fail.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        f"pid_file = {str(pid_file)!r}\n"
        "subprocess.run(['setsid', '-f', 'sh', '-c', "
        '\'echo $$ > "$0.tmp" && mv "$0.tmp" "$0" && exec sleep 600\', pid_file], check=True)\n'
        "while not os.path.exists(pid_file):\n"
        "    time.sleep(0.01)\n"
        "time.sleep(1.0)  # the scan is due from 0.5 s into the round\n"
        "sys.exit(3)\n"
    )
    try:
        proc = stalwart(
            "--nproc-per-node", "1", "--monitor-interval", "5",
            "--log-dir", tmp_path / "l", script,
            env=clean_env(STALWART_CGROUP="0"),
        )  # fmt: skip
        assert proc.returncode == 1, proc.stderr[-3000:]
        daemon = int(pid_file.read_text())
        wait_for(lambda: not alive(daemon), 10, "the daemon to die with the attempt")
    finally:
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
    evs = events(tmp_path / "l")
    order = [e["event"] for e in evs if e["event"] in ("stray_process", "workers_stopping")]
    assert order[0] == "workers_stopping", order
