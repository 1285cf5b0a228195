"""Restarts: every one must work, the count increments, the budget is enforced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.launch.workers.failures import describe_exit, read_failure, root_cause
from tests.helpers import START, events, kinds, stalwart, warm_and_cold

from .helpers import SCRIPTS

pytestmark = pytest.mark.timeout(240)


@warm_and_cold
def test_crash_restarts_in_a_row_with_real_gloo(tmp_path: Path) -> None:
    # Ten in a row where restarts are warm (the default); cold, each restart is a fresh
    # interpreter importing torch (~5 s here) over the same restart path, so four suffice
    # to show that the count, budget and blame hold from one attempt to the next.
    n = 10 if START["warm"] else 4
    out = tmp_path / "out"
    out.mkdir()
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(n),
        "--log-dir",
        tmp_path / "logs",
        SCRIPTS / "gloo_restart.py",
        str(n),
        out,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Every attempt formed its process group: both ranks passed the all_reduce.
    for attempt in range(n + 1):
        for rank in (0, 1):
            assert (out / f"ok_{attempt}_{rank}").read_text() == str(attempt)
    evs = events(tmp_path / "logs")
    restarts = [e for e in evs if e["event"] == "restart"]
    assert [e["next_attempt"] for e in restarts] == list(range(1, n + 1))
    # The rank that called sys.exit(5) is the root cause every time. Its exit code is
    # usually 5, but torch may abort it (SIGABRT) while tearing gloo down at exit, so the
    # recorded exception identifies it.
    causes = [e["root_cause"] for e in restarts]
    assert all(c["message"] == "SystemExit: 5" for c in causes), causes
    assert [c["rank"] for c in causes] == [a % 2 for a in range(n)], causes
    assert kinds(evs)[-2:] == ["job_succeeded", "launcher_exit"]


@warm_and_cold
def test_budget_spent_exits_nonzero_with_summary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--log-dir",
        tmp_path / "logs",
        SCRIPTS / "gloo_restart.py",
        "5",
        out,
    )
    assert proc.returncode == 1
    assert "FAILED after 2 attempt(s)" in proc.stderr
    # As above: the rank that called sys.exit(5) is named by its recorded exception; its
    # exit is code 5 unless torch aborted it while tearing gloo down at exit (CI saw that).
    assert "root cause: rank 1" in proc.stderr and "exception: SystemExit: 5" in proc.stderr
    cause_line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("root cause:"))
    assert cause_line.endswith(("exit code 5", "signal SIGABRT")), cause_line
    # The traceback shown starts at the program: no frame of ours (bootstrap, template).
    assert 'gloo_restart.py", line' in proc.stderr
    assert "stalwart/launch/" not in proc.stderr.split("traceback (last lines):")[1], proc.stderr
    # Points at the root-cause rank's folder of the last attempt; without -r there is no
    # stdout.log to name (issue 14), but its error.json is there.
    assert "error file: " in proc.stderr and "attempt_1/1/error.json" in proc.stderr
    evs = events(tmp_path / "logs")
    assert kinds(evs).count("restart") == 1 and "job_failed" in kinds(evs)
    assert evs[-1] == {**evs[-1], "event": "launcher_exit", "exit_code": 1}


@warm_and_cold
def test_summary_names_root_cause_and_its_error_file_reads_in_torch_elastic(
    tmp_path: Path,
) -> None:
    # One run serves both: the launcher's summary, and torch's reading of the error file.
    proc = stalwart("--nproc-per-node", "2", "--log-dir", tmp_path, SCRIPTS / "root_cause.py")
    assert proc.returncode == 1
    assert "root cause: rank 1" in proc.stderr
    assert "ValueError: rank one broke first" in proc.stderr
    err_file = next(tmp_path.glob("*/attempt_0/1/error.json"))
    data = json.loads(err_file.read_text())
    assert data["message"]["message"] == "ValueError: rank one broke first"
    assert "root_cause.py" in data["message"]["extraInfo"]["py_callstack"]
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure as TorchFailure

    tf = TorchFailure(local_rank=1, pid=1, exitcode=1, error_file=str(err_file))
    # torch keeps the whole message record and parses the whole-second timestamp.
    assert tf.message["message"] == "ValueError: rank one broke first"
    assert "root_cause.py" in tf.message["extraInfo"]["py_callstack"]
    assert tf.timestamp > 1_700_000_000


def test_root_cause_is_the_earliest_failure() -> None:
    late = read_failure(0, 10, 1, exited_at=100.5, rank=0)
    early = read_failure(1, 11, -9, exited_at=100.2, rank=1)
    assert root_cause([late, early]) is early
    assert describe_exit(early) == "signal SIGKILL"
