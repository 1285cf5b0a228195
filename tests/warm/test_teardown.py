"""Teardown and the learned template: nothing is forked once the launcher's teardown
began, and when ``WarmPool.close()`` returns no template of the run is left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, clean_env

HERE = Path(__file__).parent
pytestmark = pytest.mark.timeout(180)


def test_close_during_a_learned_takeover_returns_with_every_template_gone(
    tmp_path: Path,
) -> None:
    # The learned template has just replaced the serving one when close() starts: the
    # serving one used to be stopped by the learning thread after close() had returned,
    # so the launcher went on (cgroup, guardian, exit) with a template still alive.
    proc = subprocess.run(
        [sys.executable, str(HERE / "programs" / "takeover.py"), str(tmp_path / "t.log"), "2"],
        capture_output=True,
        text=True,
        timeout=150,
        env=clean_env(OMP_NUM_THREADS="1"),  # as the launcher sets for several workers
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    kinds = [k for k, _after in out["events"]]
    assert kinds.count("template_start") == 1 and "template_learn" in kinds, kinds
    assert kinds[-1] == "template_ready", kinds  # the learned template's, then nothing
    assert out["alive_at_return"] == [], out
    assert not any(after for _k, after in out["events"]), out["events"]
    assert out["children"] == [] and out["alive_later"] == [], out
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
