"""Crash loops stopped: a restart that cannot help is not made (real launchers, real
workers on gloo, programs that never import stalwart unless they report steps)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import events, free_port, kinds, stalwart, start_stalwart

pytestmark = pytest.mark.timeout(180)

SCRIPTS = Path(__file__).parent / "crashloop_scripts"


def _job(
    tmp_path: Path, *args: str | Path, restarts: int = 5, timeout: float = 150
) -> subprocess.CompletedProcess[str]:
    """``stalwart run ARGS`` (flags, then the program and its arguments) with two ranks
    and ``restarts`` restarts; its events go under ``tmp_path/l``."""
    return stalwart(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "--log-dir",
        tmp_path / "l",
        *args,
        timeout=timeout,
    )


def _attempts(evs: list[dict[str, object]]) -> list[object]:
    return [e["attempt"] for e in evs if e["event"] == "rendezvous_done"]


def test_the_same_error_three_times_stops_with_the_no_requeue_code(tmp_path: Path) -> None:
    proc = _job(tmp_path, SCRIPTS / "missing_key.py")
    assert proc.returncode == 93, proc.stderr
    evs = events(tmp_path / "l")
    assert _attempts(evs) == [0, 1, 2]
    failed = [e for e in evs if e["event"] == "job_failed"]
    assert len(failed) == 1 and failed[0]["attempt"] == 2
    verdict = str(failed[0]["verdict"])
    assert "rank 1" in verdict and "ValueError: config key 'lr' missing" in verdict
    assert "(0, 1, 2)" in verdict and "do not requeue" in verdict
    assert kinds(evs)[-1] == "launcher_exit" and evs[-1]["exit_code"] == 93
    line = next(ln for ln in proc.stderr.splitlines() if "crash loop" in ln)
    assert "rank 1" in line and "config key 'lr' missing" in line and "93" in line


def test_the_code_and_the_count_are_settings(tmp_path: Path) -> None:
    proc = _job(
        tmp_path,
        "--max-no-progress-attempts",
        "2",
        "--no-requeue-exit-code",
        "42",
        SCRIPTS / "missing_key.py",
    )
    assert proc.returncode == 42, proc.stderr
    assert _attempts(events(tmp_path / "l")) == [0, 1]


def test_zero_turns_the_verdict_off(tmp_path: Path) -> None:
    proc = _job(tmp_path, "--max-no-progress-attempts", "0", SCRIPTS / "missing_key.py", restarts=2)
    assert proc.returncode == 1, proc.stderr
    assert _attempts(events(tmp_path / "l")) == [0, 1, 2]
    assert "crash loop" not in proc.stderr


def test_an_error_of_stop_on_stops_at_once(tmp_path: Path) -> None:
    # ModuleNotFoundError is an ImportError: the built-in hierarchy counts.
    proc = _job(tmp_path, "--stop-on", "ImportError,SyntaxError", SCRIPTS / "import_error.py")
    assert proc.returncode == 93, proc.stderr
    assert _attempts(events(tmp_path / "l")) == [0]
    assert "ModuleNotFoundError" in proc.stderr and "--stop-on" in proc.stderr


def test_a_job_that_fails_the_same_way_while_progressing_runs_on(tmp_path: Path) -> None:
    # Three failures with the same cause, each a few steps further than the last.
    proc = _job(tmp_path, SCRIPTS / "flaky_progress.py", tmp_path, "3", timeout=170)
    assert proc.returncode == 0, proc.stderr
    evs = events(tmp_path / "l")
    assert _attempts(evs) == [0, 1, 2, 3]
    causes = [e["root_cause"]["message"] for e in evs if e["event"] == "restart"]
    assert causes == ["RuntimeError: bad batch"] * 3


@pytest.mark.parametrize(
    "value",
    ["-1", "x"],
)
def test_a_bad_count_is_one_line(tmp_path: Path, value: str) -> None:
    proc = stalwart("--max-no-progress-attempts", value, SCRIPTS / "missing_key.py", timeout=60)
    assert proc.returncode != 0
    assert "unrecognized" not in proc.stderr and "Traceback" not in proc.stderr
    want = "invalid int value: 'x'" if value == "x" else "-1: expected a count >= 0"
    assert want in proc.stderr


@pytest.mark.parametrize("value", ["0", "1", "3", "128", "256", "abc"])
def test_a_bad_exit_code_is_one_line(value: str) -> None:
    proc = stalwart("--no-requeue-exit-code", value, SCRIPTS / "missing_key.py", timeout=60)
    assert proc.returncode != 0 and proc.returncode != 93
    assert "unrecognized" not in proc.stderr and "Traceback" not in proc.stderr
    assert f"--no-requeue-exit-code {value}: expected 2..125" in proc.stderr or (
        value == "abc" and "invalid int value: 'abc'" in proc.stderr
    )


@pytest.mark.parametrize(
    "value", ["Import Error", "os.system('x')", "1abc", ",".join(f"E{i}" for i in range(65))]
)
def test_a_bad_stop_on_is_one_line(value: str) -> None:
    proc = stalwart("--stop-on", value, SCRIPTS / "missing_key.py", timeout=60)
    assert proc.returncode != 0
    assert "unrecognized" not in proc.stderr and "Traceback" not in proc.stderr
    assert "--stop-on" in proc.stderr and "expected" in proc.stderr


def test_a_syntax_error_of_stop_on_stops_at_once(tmp_path: Path) -> None:
    script = tmp_path / "syntax_error.py"
    script.write_text("# cannot even be compiled, in every attempt\nx = (\n")
    proc = _job(tmp_path, "--stop-on", "SyntaxError", script)
    assert proc.returncode == 93, proc.stderr
    assert _attempts(events(tmp_path / "l")) == [0]
    assert "SyntaxError" in proc.stderr


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_every_node_stops_with_the_same_code(tmp_path: Path, backend: str) -> None:
    port = str(free_port())
    where = (
        ["--master-addr", "127.0.0.1", "--master-port", port]
        if backend == "static"
        else ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    )
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "5",
        *where,
        "--rdzv-id",
        "loop",
    ]
    node1 = start_stalwart(
        *common, "--node-rank", "1", "--log-dir", tmp_path / "n1", SCRIPTS / "missing_key.py"
    )
    node0 = stalwart(
        *common,
        "--node-rank",
        "0",
        "--log-dir",
        tmp_path / "n0",
        SCRIPTS / "missing_key.py",
        timeout=150,
    )
    _, err1 = node1.communicate(timeout=60)
    assert node0.returncode == 93, node0.stderr[-3000:]
    assert node1.returncode == 93, err1[-3000:]
    for log in ("n0", "n1"):
        evs = events(tmp_path / log)
        assert _attempts(evs) == [0, 1, 2], log
        assert evs[-1]["event"] == "launcher_exit" and evs[-1]["exit_code"] == 93
