"""Nothing the job started outlives it: not even a daemon that left the worker's
session (setsid), double-forked and cleared its environment (env -i), which neither the
process group nor the run token in the environment can find."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart.launch.workers.cgroup import _own_path, _parent_dir, _v2_mount
from tests.helpers import alive, clean_env, stalwart, start_stalwart, wait_for, warm_and_cold

from .helpers import SCRIPTS

pytestmark = pytest.mark.timeout(90)


def _cgroup_usable() -> bool:
    parent = _parent_dir()
    return parent is not None and os.access(parent, os.W_OK)


# "subreaper": cgroups switched off, what a child subreaper sees must do.
MODES = ["cgroup", "subreaper"]


def _env(mode: str) -> dict[str, str]:
    if mode == "cgroup" and not _cgroup_usable():
        pytest.skip("cgroup v2 is not mounted or not writable here")
    return clean_env(STALWART_CGROUP="1" if mode == "cgroup" else "0")


@pytest.fixture(autouse=True)
def _no_daemon_outlives_a_failed_test(tmp_path: Path) -> Iterator[None]:
    yield
    for pid in _daemons(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _daemons(out: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(out.glob("daemon_*")) if not p.name.endswith("tmp")]


def _strays(log_dir: Path) -> list[dict[str, Any]]:
    path = next(log_dir.iterdir()) / "events.jsonl"
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the line being written
        if event["event"] == "stray_process":
            found.append(event)
    return found


def _job_cgroups(out: Path) -> set[Path]:
    """The job cgroup folders this job's workers ran in, as they recorded them.

    Only this job's own: other jobs on the machine (parallel test runs, benchmarks)
    create and remove theirs meanwhile."""
    mount = _v2_mount(Path("/proc/self/mountinfo").read_text())
    found = set()
    for rec in out.glob("cgroup_*"):
        parts = Path(rec.read_text().strip()).parts
        for i, part in enumerate(parts):
            if part.startswith("stalwart-"):
                assert mount is not None
                found.add(mount.joinpath(*parts[1 : i + 1]))
    return found


def _cgroups_as_expected(out: Path, mode: str) -> set[Path]:
    """This job's cgroups: the workers ran in one exactly with cgroups on, else in none."""
    ours = _job_cgroups(out)
    assert len(ours) == (1 if mode == "cgroup" else 0), ours
    return ours


@warm_and_cold
@pytest.mark.parametrize("mode", MODES)
def test_daemon_dies_at_normal_exit(tmp_path: Path, mode: str) -> None:
    proc = stalwart(
        "--nproc-per-node", "2", "--log-dir", tmp_path / "logs",
        SCRIPTS / "daemon.py", tmp_path, "exit", env=_env(mode),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    daemons = _daemons(tmp_path)
    assert len(daemons) == 2
    wait_for(lambda: not any(alive(p) for p in daemons), 5, "the daemons to die")
    assert not any(p.exists() for p in _cgroups_as_expected(tmp_path, mode))


@warm_and_cold
@pytest.mark.parametrize("mode", MODES)
def test_daemon_dies_at_each_restart(tmp_path: Path, mode: str) -> None:
    proc = stalwart(
        "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", tmp_path / "logs",
        SCRIPTS / "daemon.py", tmp_path, "fail", env=_env(mode),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    first = [int((tmp_path / f"daemon_0_{r}").read_text()) for r in (0, 1)]
    second = [int((tmp_path / f"daemon_1_{r}").read_text()) for r in (0, 1)]
    # The first attempt's daemons were gone before the second attempt's workers ran:
    # each is checked dead by now, and none is a pid reused by the second attempt.
    assert not set(first) & set(second)
    wait_for(lambda: not any(alive(p) for p in first + second), 5, "the daemons to die")


@warm_and_cold
@pytest.mark.parametrize("mode", MODES)
def test_daemon_dies_when_launcher_is_sigkilled(tmp_path: Path, mode: str) -> None:
    proc = start_stalwart(
        "--nproc-per-node", "2", "--log-dir", tmp_path / "logs",
        SCRIPTS / "daemon.py", tmp_path, "wait", env=_env(mode),
    )  # fmt: skip
    try:
        wait_for(lambda: all((tmp_path / f"ready_0_{r}").exists() for r in (0, 1)), 60, "workers")
        daemons = _daemons(tmp_path)
        assert len(daemons) == 2 and all(alive(p) for p in daemons)
        # Without a cgroup the launcher hands strays to the guardian as it sees them.
        wait_for(
            lambda: set(daemons) <= {e["pid"] for e in _strays(tmp_path / "logs")},
            10,
            "the launcher to report the daemons",
        )
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=10)
    wait_for(lambda: not any(alive(p) for p in daemons), 5, "the guardian to kill the daemons")
    ours = _cgroups_as_expected(tmp_path, mode)
    wait_for(lambda: not any(p.exists() for p in ours), 5, "the guardian to remove the job cgroup")


def test_cgroup_paths_parsed() -> None:
    info = (
        "30 25 0:26 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw\n"
        "31 25 0:27 / /sys/fs/cgroup/cpu rw shared:10 - cgroup cgroup rw,cpu\n"
    )
    assert _v2_mount(info) == Path("/sys/fs/cgroup/unified")
    assert _v2_mount("31 25 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n") is None
    assert _own_path("4:memory:/x\n0::/user.slice/a.scope\n") == "/user.slice/a.scope"
    assert _own_path("4:memory:/x\n") is None
