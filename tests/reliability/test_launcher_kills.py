"""The launcher SIGKILLed at chosen phases: each trial leaves no process and no file.

Phases: start (before the workers run), running, teardown (workers ignore SIGTERM and
the launcher waits out its grace), restart (the second attempt's workers run), and the
instant the guardian exits at a normal end (the last moment anything could be left).
Every worker starts a daemon with setsid and a cleared environment, the hardest kind
of process to find.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from stalwart.launch.workers.cgroup import _parent_dir
from tests.helpers import ROOT, STALWART, clean_env, wait_for
from tests.launch.helpers import SCRIPTS

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(120)]

TRIALS = int(os.environ.get("STALWART_KILL_TRIALS", "2"))


def _launch(tmp: Path, run_id: str, mode: str, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *STALWART, "run", "--nproc-per-node", "2", "--rdzv-id", run_id,
            "--log-dir", str(tmp / "logs"), *extra,
            str(SCRIPTS / "daemon.py"), str(tmp), mode,
        ],
        env=clean_env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _tree(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _ours(tmp: Path) -> set[int]:
    """Every live process whose command line names this trial's folder."""
    found = set()
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if any(str(tmp) in arg for arg in p.info["cmdline"] or ()):
            found.add(p.pid)
    return found


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _leftovers(run_id: str) -> list[Path]:
    found = list(Path(tempfile.gettempdir()).glob(f"stalwart-{run_id}-*"))
    parent = _parent_dir()
    return found + ([] if parent is None else list(parent.glob("stalwart-*")))


def _sigkill_and_check(proc: subprocess.Popen[bytes], tmp: Path, run_id: str) -> None:
    seen = _tree(proc.pid) | _ours(tmp)
    before_cgroups = set(_leftovers("\0"))  # cgroups of other jobs are not ours to judge
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    try:
        wait_for(lambda: not any(_alive(p) for p in seen | _ours(tmp)), 10, "every process to die")
        wait_for(
            lambda: not (set(_leftovers(run_id)) - before_cgroups),
            10,
            "the monitor folder and job cgroup to go",
        )
    finally:
        for pid in seen | _ours(tmp):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _ready(tmp: Path, attempt: int) -> bool:
    return all((tmp / f"ready_{attempt}_{r}").exists() for r in (0, 1))


@pytest.mark.parametrize("trial", range(TRIALS))
def test_sigkill_during_start(tmp_path: Path, trial: int) -> None:
    run_id = uuid.uuid4().hex[:12]
    proc = _launch(tmp_path, run_id, "wait")
    # Anywhere from the launcher's first imports to the workers' first steps.
    time.sleep(random.uniform(0.0, 1.5))
    _sigkill_and_check(proc, tmp_path, run_id)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_sigkill_while_running(tmp_path: Path, trial: int) -> None:
    run_id = uuid.uuid4().hex[:12]
    proc = _launch(tmp_path, run_id, "wait")
    wait_for(lambda: _ready(tmp_path, 0), 60, "workers to run")
    _sigkill_and_check(proc, tmp_path, run_id)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_sigkill_during_teardown(tmp_path: Path, trial: int) -> None:
    run_id = uuid.uuid4().hex[:12]
    proc = _launch(tmp_path, run_id, "ignore", "--shutdown-timeout", "3")
    wait_for(lambda: _ready(tmp_path, 0), 60, "workers to run")
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: (tmp_path / "term_0").exists(), 10, "the workers to get SIGTERM")
    time.sleep(random.uniform(0.0, 2.0))  # somewhere in the 3 s grace
    _sigkill_and_check(proc, tmp_path, run_id)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_sigkill_during_restart(tmp_path: Path, trial: int) -> None:
    run_id = uuid.uuid4().hex[:12]
    proc = _launch(tmp_path, run_id, "failwait", "--max-restarts", "1")
    wait_for(lambda: (tmp_path / "daemon_1_0").exists(), 60, "the second attempt to start")
    _sigkill_and_check(proc, tmp_path, run_id)


def test_sigkill_when_guardian_exits(tmp_path: Path) -> None:
    """The last instant of a normal end: the guardian has been told to exit.  Everything
    must be gone by then (it used to be told before the monitor folder was removed)."""
    run_id = uuid.uuid4().hex[:12]
    proc = _launch(tmp_path, run_id, "exit")

    def guardian() -> psutil.Process | None:
        for p in _tree(proc.pid):
            with contextlib.suppress(psutil.Error):
                child = psutil.Process(p)
                if "stalwart.launch.workers.guardian" in child.cmdline():
                    return child
        return None

    g = wait_for(guardian, 60, "the guardian to start")
    daemons: set[int] = set()

    def guardian_gone() -> bool:
        daemons.update(int(f.read_text()) for f in tmp_path.glob("daemon_0_?"))
        try:
            return g.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    try:
        wait_for(guardian_gone, 60, "the guardian to exit", interval=0.0005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert not list(Path(tempfile.gettempdir()).glob(f"stalwart-{run_id}-*"))
        assert not any(_alive(p) for p in daemons)
    finally:
        for pid in daemons | _ours(tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
