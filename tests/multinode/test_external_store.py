"""c10d rendezvous on a store that no launcher hosts (``is_host=0`` everywhere)."""

from __future__ import annotations

import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from bench.netns import TRAIN
from tests.helpers import ROOT, clean_env, stalwart_argv
from tests.multinode.test_netns import reference_state

pytestmark = pytest.mark.timeout(180)


def _run(port: int, tmp_path: Path, name: str, steps: str = "20") -> subprocess.Popen[str]:
    return subprocess.Popen(
        stalwart_argv(
            "--nnodes",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "ext",
            "--rdzv-conf",
            "is_host=0,join_timeout=60,keep_alive_interval=0.5",
            "--log-dir",
            tmp_path / name,
            TRAIN,
            steps,
            tmp_path,
        ),
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_job_on_an_external_store_then_its_id_is_spent(tmp_path: Path) -> None:
    store = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    procs = [_run(store.port, tmp_path, n) for n in ("a", "b")]
    for p in procs:
        out, _ = p.communicate(timeout=150)
        assert p.returncode == 0, out[-3000:]
    assert store.get("run_id") == b"ext"
    got, want = torch.load(tmp_path / "final.pt"), reference_state(20)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
    # The job is over: a launcher that comes late with the same id is told so at once.
    late = _run(store.port, tmp_path, "late")
    out, _ = late.communicate(timeout=60)
    assert late.returncode == 3, out
    assert "belongs to a job that already ended" in out
