"""The launcher's teardown closes every resource, whatever one of them raises."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import ROOT, clean_env, events, kinds

from .helpers import SCRIPTS

pytestmark = pytest.mark.timeout(120)


def test_a_rendezvous_that_fails_to_leave_skips_no_other_teardown(tmp_path: Path) -> None:
    """``leave()`` raising (a store already gone) still stops the guardian, the warm
    template and the hang monitor, writes ``launcher_exit`` and restores the signal
    handlers; the error itself still reaches the caller."""
    script = tmp_path / "ok.py"
    script.write_text("print('worker done')\n")
    run_id = f"teardown-{tmp_path.name}"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "leave_raises.py"),
            "--nproc-per-node",
            "2",
            "--rdzv-id",
            run_id,
            "--log-dir",
            str(tmp_path / "logs"),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env=clean_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["error"] == "leave failed"
    assert report["children"] == []  # the guardian, the warm template, the workers
    assert report["handler_restored"]
    evs = events(tmp_path / "logs")
    assert kinds(evs)[-1] == "launcher_exit" and evs[-1]["exit_code"] == 0
    assert "job_succeeded" in kinds(evs)
    assert not list(Path(tempfile.gettempdir()).glob(f"stalwart-{run_id}-*"))  # hang monitor
