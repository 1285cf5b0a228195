"""A node's compute check under its own CPU limit: the limit counts even in a burst that
never hits it (on a host so busy that the thread gets less than its limit anyway)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.health.local import cpu_limit, cpu_share
from tests.helpers import ROOT, free_port

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("quota", "period", "share"),
    [
        ("10000", "100000", 0.1),
        ("250000", "100000", 2.5),
        ("max", "100000", None),  # cgroup v2: no limit
        ("-1", "100000", None),  # cgroup v1: no limit
        ("-1\n", "100000\n", None),
        ("150000\n", "1000000\n", 0.15),
        ("0", "100000", None),
        ("10000", "0", None),
        ("lots", "100000", None),
        ("", "", None),
        ("9" * 400, "1", None),
    ],
)
def test_cpu_share_reads_a_cfs_limit(quota: str, period: str, share: float | None) -> None:
    assert cpu_share(quota, period) == share


@pytest.mark.parametrize("text", ["max 100000", "20000 100000", "junk", "", "-5 100000"])
def test_cpu_limit_reads_the_tightest_of_the_folder_and_its_parents(
    tmp_path: Path, text: str
) -> None:
    parent = tmp_path / "cg"
    child = parent / "job"
    child.mkdir(parents=True)
    (parent / "cpu.max").write_text("50000 100000\n")
    (child / "cpu.max").write_text(text + "\n")
    want = 0.2 if text == "20000 100000" else 0.5
    assert cpu_limit(child) == want


RATE = "from stalwart.health.local import compute_rate, cpu_limit; import json; " + (
    "print(json.dumps([compute_rate(), cpu_limit()]))"
)


@pytest.fixture
def loose_limit() -> Iterator[Path]:
    """A cgroup allowing 0.15 CPU over 1 s periods: a 0.12 s burst fits in one period's
    quota, so the first burst never hits the limit (as on a busy host)."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if os.geteuid() != 0:
        pytest.skip("needs root to make a cgroup")
    if (v1 / "cpu.cfs_quota_us").exists():
        group = v1 / f"swlocal{free_port()}"
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("1000000")
        (group / "cpu.cfs_quota_us").write_text("150000")
    else:
        root = Path("/sys/fs/cgroup")
        if "cpu" not in (root / "cgroup.controllers").read_text().split():
            pytest.skip("no cpu controller to limit a process with")
        group = root / f"swlocal{free_port()}"
        group.mkdir()
        (group / "cpu.max").write_text("150000 1000000")
    try:
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        group.rmdir()


def _rate(group: Path | None) -> tuple[float, float | None]:
    # Joins the cgroup before it measures (a shell moves itself in, then execs python).
    cmd = [sys.executable, "-c", RATE]
    if group is not None:
        cmd = ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=50, cwd=ROOT, check=True)
    rate, limit = json.loads(out.stdout)
    return float(rate), limit


def test_a_node_under_a_cpu_limit_measures_at_most_its_share(loose_limit: Path) -> None:
    free, no_limit = _rate(None)
    held, limit = _rate(loose_limit)
    assert no_limit is None and limit == pytest.approx(0.15)
    # Peers judge it below 0.3x their median: it is the slow node, however busy the host.
    assert held < 0.3 * free, (held, free)
