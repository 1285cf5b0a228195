"""Signals reach every worker's process group; nothing outlives the launcher."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.launch.workers.cgroup import _parent_dir
from tests.helpers import (
    ROOT,
    alive,
    clean_env,
    events,
    kinds,
    stalwart_argv,
    start_stalwart,
    wait_for,
    warm_and_cold,
)

from .helpers import SCRIPTS

# Warm and cold, except where no worker starts at all (then the cold run repeats the
# warm one's path without the template).
pytestmark = pytest.mark.timeout(60)


def _pids(out: Path, n: int) -> list[tuple[int, int]]:
    def ready() -> list[tuple[int, int]] | None:
        files = [out / f"pids_{r}" for r in range(n)]
        if not all(f.exists() and f.read_text().endswith("\n") for f in files):
            return None
        return [tuple(map(int, f.read_text().split())) for f in files]  # type: ignore[misc]

    return wait_for(ready, 30, "workers to record their pids")


@warm_and_cold
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_signal_forwarded_to_workers_and_grandchildren(tmp_path: Path, sig: signal.Signals) -> None:
    proc = start_stalwart(
        "--nproc-per-node",
        "2",
        "--log-dir",
        tmp_path / "logs",
        SCRIPTS / "sleeper.py",
        tmp_path,
        "log",
    )
    pids = _pids(tmp_path, 2)
    proc.send_signal(sig)
    proc.wait(30)
    assert proc.returncode == 128 + sig
    for rank in (0, 1):
        assert (tmp_path / f"term_{rank}").read_text() == sig.name
    for worker, grandchild in pids:
        wait_for(lambda w=worker, g=grandchild: not alive(w) and not alive(g), 5, "tree to die")
    evs = events(tmp_path / "logs")
    assert "shutdown" in kinds(evs) and kinds(evs)[-1] == "launcher_exit"


@warm_and_cold
@pytest.mark.parametrize("caught", ["Exception", "BaseException"])
def test_a_signal_whose_exception_was_swallowed_still_stops_the_job(
    tmp_path: Path, caught: str
) -> None:
    """The handler raises wherever the main thread is; code there that catches everything
    must not keep the job running (a SIGINT was once lost that way under load)."""
    run = stalwart_argv(
        "--nproc-per-node", "2", "--log-dir", tmp_path / "logs",
        SCRIPTS / "sleeper.py", tmp_path, "log",
    )[3:]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, SCRIPTS / "swallowing_launcher.py", caught, tmp_path, *run],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        cwd=ROOT,
    )
    try:
        _, err = proc.communicate(timeout=45)
    finally:
        proc.kill()
    # A BaseException passes ``except Exception``; under ``except BaseException`` the
    # round loop acts on the signal the handler saw.
    assert (tmp_path / "swallowed").exists() == (caught == "BaseException")
    assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
    for rank in (0, 1):
        assert (tmp_path / f"term_{rank}").read_text() == "SIGINT"


@warm_and_cold
def test_term_then_kill_after_shutdown_timeout(tmp_path: Path) -> None:
    proc = start_stalwart(
        "--nproc-per-node",
        "1",
        "--shutdown-timeout",
        "1",
        "--log-dir",
        tmp_path / "logs",
        SCRIPTS / "sleeper.py",
        tmp_path,
        "ignore",
    )
    ((worker, grandchild),) = _pids(tmp_path, 1)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    elapsed = time.monotonic() - t0
    assert (tmp_path / "term_0").read_text() == "SIGTERM"  # it got TERM and ignored it ...
    assert not alive(worker) and not alive(grandchild)  # ... so it got KILL
    assert 1.0 <= elapsed < 10, elapsed
    exits = [e for e in events(tmp_path / "logs") if e["event"] == "worker_exit"]
    assert exits[0]["signal"] == "SIGKILL"


@warm_and_cold
def test_no_orphans_when_launcher_is_sigkilled(tmp_path: Path) -> None:
    proc = start_stalwart(
        "--nproc-per-node",
        "2",
        "--log-dir",
        tmp_path / "logs",
        SCRIPTS / "sleeper.py",
        tmp_path,
        "ignore",
    )
    pids = _pids(tmp_path, 2)
    proc.kill()
    proc.wait(10)
    t0 = time.monotonic()
    everyone = [p for pair in pids for p in pair]
    wait_for(lambda: not any(alive(p) for p in everyone), 2.0, "workers and grandchildren to die")
    assert time.monotonic() - t0 < 2.0
    # The hang monitor's private folder (pipe, shared memory) is removed by the guardian.
    ipc = Path(
        next(e for e in events(tmp_path / "logs") if e["event"] == "monitor_started")["run_dir"]
    )
    wait_for(lambda: not ipc.exists(), 5.0, "the monitor's folder to be removed")


FREEZER = Path("/sys/fs/cgroup/freezer")


@warm_and_cold
@pytest.mark.skipif(
    not (FREEZER / "cgroup.procs").exists() or os.geteuid() != 0,
    reason="needs root and a cgroup-v1 freezer to put a worker in uninterruptible sleep",
)
def test_worker_in_uninterruptible_sleep_does_not_wedge_launcher(tmp_path: Path) -> None:
    group = FREEZER / f"stalwart_test_{os.getpid()}_{tmp_path.name}"
    group.mkdir(exist_ok=True)
    job_cgroups = _parent_dir()
    before = set(job_cgroups.glob("stalwart-*")) if job_cgroups else set()
    # The abandoned worker outlives the launcher; as our orphan (not PID 1's, which may
    # leave it a zombie for a long time) we can reap it, and only an empty cgroup can go.
    _set_subreaper(True)
    proc = start_stalwart(
        "--nproc-per-node",
        "1",
        "--shutdown-timeout",
        "0.5",
        "--log-dir",
        tmp_path / "logs",
        # Output to files: a frozen worker holding our pipes would block communicate().
        "-r",
        "3",
        SCRIPTS / "sleeper.py",
        tmp_path,
        "log",
    )
    try:
        ((worker, _grandchild),) = _pids(tmp_path, 1)
        (group / "cgroup.procs").write_text(str(worker))
        (group / "freezer.state").write_text("FROZEN")
        wait_for(lambda: (group / "freezer.state").read_text().strip() == "FROZEN", 5, "freeze")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 15
        assert proc.returncode == 128 + signal.SIGTERM
        assert "survives SIGKILL" in err
        assert alive(worker)  # still stuck: the launcher gave up on it rather than hang
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        (group / "freezer.state").write_text("THAWED")

        def empty() -> bool:
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                pass
            return not (group / "cgroup.procs").read_text().split()

        wait_for(empty, 10, "the thawed worker to die and be reaped")
        _set_subreaper(False)
        group.rmdir()
    if job_cgroups is not None:
        # The job cgroup could not go while the worker was stuck: the guardian stayed
        # behind and removes it now that the worker is gone.
        wait_for(lambda: set(job_cgroups.glob("stalwart-*")) <= before, 10, "the job cgroup to go")


def _set_subreaper(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, int(on), 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _catches(pid: int, sig: signal.Signals) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def _importing_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("phase", ["handlers", "importing"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_in_the_first_instants_is_a_clean_shutdown(
    tmp_path: Path, sig: signal.Signals, phase: str
) -> None:
    """A signal as soon as the launcher handles SIGTERM (the first thing it does), or
    while it is still importing torch: no KeyboardInterrupt traceback, exit 128+sig, no
    worker started, and the event log still says shutdown and launcher_exit."""
    proc = start_stalwart(
        "--nproc-per-node", "1", "--log-dir", tmp_path / "logs",
        SCRIPTS / "sleeper.py", tmp_path, "log",
    )  # fmt: skip
    try:
        if phase == "handlers":
            ready = lambda: _catches(proc.pid, signal.SIGTERM)  # noqa: E731
        else:
            ready = lambda: _importing_torch(proc.pid)  # noqa: E731
        wait_for(ready, 30, f"the launcher's {phase} phase", 0.001)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == 128 + sig
    evs = events(tmp_path / "logs")
    assert "shutdown" in kinds(evs) and kinds(evs)[-1] == "launcher_exit"
    assert not list(tmp_path.glob("pids_*")), "no worker may start after the signal"
