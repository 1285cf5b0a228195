"""In-process restart + RAM restore in place (issue 16): a rank raises, both ranks
re-enter the wrapped function in the same processes and restore the newest snapshot
every rank verified from the launcher's memory into the tensors they still hold.

Real ``stalwart run --ckpt-ram``, two gloo ranks, ``stalwart.inprocess.Wrapper``;
the job is ``bench/ram_inprocess.py`` (the benchmark's own job).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import ROOT, stalwart

pytestmark = pytest.mark.timeout(150)

JOB = ROOT / "bench" / "ram_inprocess.py"


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_inprocess_restart_restores_agreed_ram_snapshot_in_place(
    tmp_path: Path, where: str
) -> None:
    crash_step, steps = 3, 6
    extra = ["--inside"] if where == "inside" else []
    res = stalwart(
        "--nproc-per-node", "2", "--max-restarts", "0", "--ckpt-ram", "16MiB",
        "--log-dir", tmp_path / "logs",
        JOB, tmp_path, "2", str(crash_step), str(steps), *extra,
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "injected fault at step 3" in res.stderr
    runs = [json.loads((tmp_path / f"run_{r}.json").read_text()) for r in (0, 1)]
    for rank, log in enumerate(runs):
        # one process per rank for the whole job: the launcher never restarted it
        assert [it["iteration"] for it in log] == [0, 1], (rank, log)
        first, second = log
        assert first["start"] == 0 and first["source"] is None
        # rank 1 saved step 3 before raising; rank 0 saved it or was interrupted
        # before: the agreed step is the same on both ranks and from RAM
        assert second["source"] == "ram", (rank, log)
        assert second["value"] == float(second["start"])  # the state of that step
        assert second["ptr"] == first["ptr"]  # restored into the tensor it held
    assert runs[0][1]["start"] == runs[1][1]["start"]
    assert runs[0][1]["start"] in (crash_step, crash_step + 1)
    assert "fault" in runs[1][0]
    assert not list((tmp_path / "ckpt").glob("step_*"))  # nothing persisted: from RAM only
