"""The README's main job: a DDP run with an injected crash ends exactly where an
uninterrupted run ends, having resumed from its last checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import ROOT, stalwart, warm_and_cold

pytestmark = [pytest.mark.timeout(240), warm_and_cold]

EXAMPLE = ROOT / "examples" / "train_ddp.py"


def _train(tmp_path: Path, name: str, *extra: str) -> tuple[dict, str]:
    out = tmp_path / f"{name}.json"
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--log-dir",
        tmp_path / name,
        *extra,
        EXAMPLE,
        "--steps",
        "30",
        "--ckpt-every",
        "10",
        "--width",
        "64",
        "--step-sleep",
        "0.1",
        "--ckpt-dir",
        tmp_path / f"{name}_ckpt",
        "--out",
        out,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run, once for both start modes: its result depends on neither."""
    result, _ = _train(tmp_path_factory.mktemp("example"), "clean")
    assert result["attempt"] == 0
    return result


def test_crash_resume_matches_uninterrupted_run(tmp_path: Path, clean: dict) -> None:
    # Five steps of 0.1 s after the checkpoint of step 20 let it commit before the crash.
    faulty, stdout = _train(tmp_path, "faulty", "--inject", "crash:rank=1,step=25")
    assert faulty["attempt"] == 1
    resumed = [ln for ln in stdout.splitlines() if "resumed from" in ln]
    assert resumed and "at step 20" in resumed[0], stdout[-2000:]
    assert faulty["checksum"] == clean["checksum"]
    assert faulty["loss"] == clean["loss"]
