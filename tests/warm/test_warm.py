"""Warm starts: a worker forked from the template behaves exactly like a cold one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import alive, clean_env, events, stalwart, start_stalwart, wait_for

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
    script = str(HERE / "semantics.py")
    assert warm[0]["orig_argv"] == [sys.executable, "-u", script, str(out), "fail"]
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


def _rand(out: Path) -> dict[tuple[int, int], dict]:
    return {
        (r, a): json.loads((out / f"rand_{r}_{a}.json").read_text()) for r in (0, 1) for a in (0, 1)
    }


def _run_randomness(tmp: Path, mode: str, how: str, env: dict[str, str]) -> dict:
    out = tmp / f"out_{mode}_{how}"
    out.mkdir()
    extra = ["--no-warm"] if mode == "cold" else ["--preload", "numpy.random"]
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--log-dir",
        tmp / f"l_{mode}_{how}",
        *extra,
        HERE / "randomness.py",
        out,
        how,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    if mode == "warm":
        ready = [e for e in events(tmp / f"l_{mode}_{how}") if e["event"] == "template_ready"]
        assert ready and "numpy.random" in ready[0]["modules"]
    return _rand(out)


def test_warm_workers_draw_fresh_random_numbers_per_rank_and_attempt(tmp_path: Path) -> None:
    got = _run_randomness(tmp_path, "warm", "unseeded", clean_env())
    for key in ("torch_initial_seed", "torch", "numpy", "random"):
        values = [json.dumps(v[key]) for v in got.values()]
        assert len(set(values)) == 4, (key, values)


def test_explicit_seeds_give_warm_workers_the_values_of_cold_ones(tmp_path: Path) -> None:
    # PYTHONHASHSEED set by the user reaches the template too, so hash() matches as well.
    env = clean_env(PYTHONHASHSEED="321")
    warm = _run_randomness(tmp_path, "warm", "seeded", env)
    cold = _run_randomness(tmp_path, "cold", "seeded", env)
    assert warm == cold
    assert len({json.dumps(v) for v in warm.values()}) == 1  # and every rank agrees


def test_learned_preload_spares_later_attempts_the_programs_imports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # A library that is slow to import, as a framework is; outside the script's folder,
    # which holds the program's own code (never preloaded).
    site = tmp_path / "site"
    site.mkdir()
    (site / "stalwart_slow_import_probe.py").write_text("import time\n\ntime.sleep(1.5)\n")
    env = clean_env(PYTHONPATH=str(site))
    proc = start_stalwart(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--log-dir",
        tmp_path / "l",
        HERE / "learner.py",
        out,
        env=env,
    )

    def learned_ready() -> bool:
        try:
            evs = events(tmp_path / "l")
        except (AssertionError, FileNotFoundError):
            return False
        return any(
            "stalwart_slow_import_probe" in (e.get("learned") or [])
            for e in evs
            if e["event"] == "template_ready"
        )

    try:
        wait_for(learned_ready, 90, "a template with the program's imports")
    finally:
        (out / "go").touch()
    assert proc.wait(90) == 0, proc.stderr.read() if proc.stderr else ""
    first = [json.loads((out / f"learn_{r}_0.json").read_text()) for r in (0, 1)]
    later = [json.loads((out / f"learn_{r}_1.json").read_text()) for r in (0, 1)]
    assert all(not f["preloaded"] and f["import_s"] >= 1.4 for f in first), first
    assert all(x["preloaded"] and x["import_s"] < 0.5 for x in later), later
    evs = events(tmp_path / "l")
    kinds = [e["event"] for e in evs]
    assert "template_learn_failed" not in kinds and kinds.count("template_learn") == 1
    # Forked from the serving template: it imported only the learned module (1.5 s),
    # not torch again.
    assert next(e for e in evs if e["event"] == "template_learn")["forked"] is True
    ready = [e for e in evs if e["event"] == "template_ready" and e.get("learned")]
    assert len(ready) == 1 and ready[0]["import_s"] < 5.0, ready


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_pgrep_finds_workers_by_script_and_arguments(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = start_stalwart(
        "--nproc-per-node",
        "2",
        "--log-dir",
        tmp_path / "l",
        *(["--no-warm"] if mode == "cold" else []),
        HERE / "waiter.py",
        out,
        "--tag-for-pgrep",
    )

    def workers() -> list[int] | None:
        try:
            evs = events(tmp_path / "l")
        except (AssertionError, FileNotFoundError):
            return None
        pids = [e["worker_pid"] for e in evs if e["event"] == "worker_spawn"]
        return pids if len(pids) == 2 else None

    try:
        pids = wait_for(workers, 60, "two workers")
        expected = f"{sys.executable} -u {HERE / 'waiter.py'} {out} --tag-for-pgrep"

        def args(pid: int) -> str:
            ps = subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(pid)], capture_output=True)
            return ps.stdout.decode().strip()

        def found() -> set[int] | None:
            res = subprocess.run(
                ["pgrep", "-f", f"waiter.py {out} --tag-for-pgrep"], capture_output=True
            )
            # The launcher's own command line names the script too (as torchrun's does);
            # the workers' are exactly a cold ``python -u`` worker's.
            got = {int(p) for p in res.stdout.split() if args(int(p)) == expected}
            return got if got == set(pids) else None

        # The title is set as the worker starts; poll until both have it.
        wait_for(found, 20, f"pgrep to find workers {pids} as {expected!r}")
    finally:
        (out / "go").touch()
    proc.wait(90)


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_traceback_starts_at_the_users_script(tmp_path: Path, mode: str) -> None:
    proc = stalwart(
        "--nproc-per-node",
        "1",
        "--log-dir",
        tmp_path / "l",
        *(["--no-warm"] if mode == "cold" else []),
        HERE / "failing.py",
        "--an-arg",
    )
    assert proc.returncode == 1, proc.stderr
    script = str(HERE / "failing.py")
    lines = proc.stderr.splitlines()
    i = lines.index("Traceback (most recent call last):")
    assert lines[i + 1] == f'  File "{script}", line 16, in <module>', lines[i : i + 4]
    assert not any(w in proc.stderr for w in ("runpy", "zygote.py", "bootstrap.py"))
    stdout = json.loads(proc.stdout.splitlines()[0])
    assert stdout == {
        "argv": [script, "--an-arg"],
        "orig_argv": [sys.executable, "-u", script, "--an-arg"],
    }
    err = json.loads(next((tmp_path / "l").glob("*/attempt_0/0/error.json")).read_text())
    stack = err["message"]["extraInfo"]["py_callstack"].splitlines()
    assert stack[0] == "Traceback (most recent call last):"
    assert stack[1] == f'  File "{script}", line 16, in <module>', stack
    assert not any("runpy" in s or "zygote" in s or "bootstrap" in s for s in stack)


def test_job_ending_while_a_learned_template_imports_ends_quietly(tmp_path: Path) -> None:
    # The launcher shuts the learned template's socket while the thread preparing it
    # still waits on it: that thread used to die with "Bad file descriptor" on stderr.
    site = tmp_path / "site"
    site.mkdir()
    (site / "stalwart_slow_import_probe.py").write_text("import time\n\ntime.sleep(2)\n")
    proc = stalwart(
        "--nproc-per-node",
        "1",
        "--log-dir",
        tmp_path / "l",
        HERE / "learn_then_end.py",
        env=clean_env(PYTHONPATH=str(site)),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr
    kinds = [e["event"] for e in events(tmp_path / "l")]
    assert "template_learn" in kinds and "template_learn_failed" not in kinds
