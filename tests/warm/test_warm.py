"""Warm starts: a worker forked from the template behaves exactly like a cold one."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.launch.helpers import alive, clean_env, events, stalwart, start_stalwart, wait_for

HERE = Path(__file__).parent
pytestmark = pytest.mark.timeout(120)


def _sem(out: Path, mode: str) -> dict:
    return {r: json.loads((out / f"sem_{r}_{mode}.json").read_text()) for r in (0, 1)}


def test_warm_worker_sees_what_a_cold_one_sees(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    results = {}
    for mode, extra in (("warm", []), ("cold", ["--no-warm"])):
        proc = stalwart(
            "--nproc-per-node",
            "2",
            "-r",
            "1",
            "--log-dir",
            tmp_path / mode,
            *extra,
            HERE / "semantics.py",
            out,
            "fail",
            env=clean_env(SEMANTICS_VAR="hello"),
        )
        assert proc.returncode == 1, proc.stderr
        assert "root cause: rank 0" in proc.stderr and "exit code 7" in proc.stderr
        results[mode] = _sem(out, mode)
        # stdout was redirected to the per-rank file in both modes
        assert (
            "semantics rank 1"
            in next((tmp_path / mode).glob("*/attempt_0/1/stdout.log")).read_text()
        )
    warm, cold = results["warm"], results["cold"]
    assert warm == cold
    assert warm[0]["name"] == "__main__" and warm[0]["argv"] == [str(out), "fail"]
    assert warm[0]["path0"] == str(HERE) and warm[0]["custom"] == "hello"
    assert warm[1]["sigterm"] and warm[1]["sigint"] and warm[1]["sigmask"] == []
    assert warm[1]["pgid_is_pid"] and warm[1]["main_file"] == "semantics.py"
    kinds = [e["event"] for e in events(tmp_path / "warm")]
    assert "template_ready" in kinds
    ready = next(e for e in events(tmp_path / "warm") if e["event"] == "template_ready")
    assert ready["rss_bytes"] > 50 << 20  # torch is in there, shared copy-on-write


def test_template_killed_mid_run_is_recreated(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = start_stalwart(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--log-dir",
        tmp_path / "l",
        HERE / "waiter.py",
        out,
    )

    def template_pid() -> int | None:
        try:
            evs = events(tmp_path / "l")
        except (AssertionError, FileNotFoundError):
            return None
        ready = [e for e in evs if e["event"] == "template_ready"]
        spawned = [e for e in evs if e["event"] == "worker_spawn"]
        return ready[0]["template_pid"] if ready and len(spawned) == 2 else None

    pid = wait_for(template_pid, 60, "the template to serve attempt 0")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), 5, "the template to die")
    (out / "go").touch()
    assert proc.wait(90) == 0, proc.stderr.read() if proc.stderr else ""
    kinds = [e["event"] for e in events(tmp_path / "l")]
    assert kinds.count("template_ready") == 2 and "template_died" in kinds
    assert (out / "done_0").exists() and (out / "done_1").exists()


def test_failing_preload_falls_back_to_cold_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "--preload",
        "no_such_module_xyz",
        "--log-dir",
        tmp_path / "l",
        HERE / "semantics.py",
        out,
    )
    assert proc.returncode == 0, proc.stderr
    notices = [ln for ln in proc.stderr.splitlines() if "warm start disabled" in ln]
    assert len(notices) == 1 and "no_such_module_xyz" in notices[0]
    assert "ModuleNotFoundError" in notices[0]
    assert _sem(out, "cold")[0]["name"] == "__main__"  # the workers ran, cold
    unusable = [e for e in events(tmp_path / "l") if e["event"] == "template_unusable"]
    assert len(unusable) == 1


def test_template_and_workers_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = start_stalwart(
        "--nproc-per-node", "2", "--log-dir", tmp_path / "l", HERE / "waiter.py", out
    )

    def pids() -> list[int] | None:
        try:
            evs = events(tmp_path / "l")
        except (AssertionError, FileNotFoundError):
            return None
        ready = [e["template_pid"] for e in evs if e["event"] == "template_ready"]
        workers = [e["worker_pid"] for e in evs if e["event"] == "worker_spawn"]
        return ready + workers if ready and len(workers) == 2 else None

    everyone = wait_for(pids, 60, "template and workers")
    proc.kill()
    proc.wait(10)
    t0 = time.monotonic()
    wait_for(lambda: not any(alive(p) for p in everyone), 2.0, "template and workers to die")
    assert time.monotonic() - t0 < 2.0
