"""Real frameworks under ``stalwart run``, unchanged: a Lightning ``Trainer`` and a
transformers ``Trainer`` (2 ranks, DDP on gloo) each take one injected fault, restart,
resume from the checkpoint the framework itself wrote, and finish."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, clean_env, stalwart_argv

HERE = Path(__file__).parent
STEPS, CKPT_EVERY, FAULT_AT = 12, 4, 7
SAVED = FAULT_AT // CKPT_EVERY * CKPT_EVERY  # the last checkpoint before the fault

pytestmark = pytest.mark.timeout(180)


def run(script: str, work: Path, fault: str) -> tuple[subprocess.CompletedProcess[str], list[Any]]:
    env = clean_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(work / "hf_home"))
    proc = subprocess.run(
        stalwart_argv("--nproc-per-node", "2",
         "--max-restarts", "1", "--inject", f"{fault}:rank=1,step={FAULT_AT}",
         "--log-dir", work / "logs", HERE / script, work, str(STEPS), str(CKPT_EVERY)),
        capture_output=True, text=True, timeout=170, env=env, cwd=ROOT,
    )  # fmt: skip
    progress = work / "p.jsonl"
    recs = [json.loads(x) for x in progress.read_text().splitlines()] if progress.exists() else []
    return proc, recs


def check_resumed(proc: subprocess.CompletedProcess[str], recs: list[dict[str, Any]]) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]
    starts = [(r["attempt"], r["step"]) for r in recs if r["event"] == "start"]
    assert starts == [(0, 0), (1, SAVED)], starts
    first = [r["step"] for r in recs if r["event"] == "step" and r["attempt"] == 0]
    again = [r["step"] for r in recs if r["event"] == "step" and r["attempt"] == 1]
    assert first[-1] == FAULT_AT, first
    assert again == list(range(SAVED + 1, STEPS + 1)), again
    assert "restarting (1 of 1)" in proc.stderr


def test_lightning_trainer_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="install the test extra: pip install -e '.[test]'")
    proc, recs = run("lightning_job.py", tmp_path, "raise")
    check_resumed(proc, recs)
    assert (tmp_path / "ckpt" / "last.ckpt").is_file()
    assert "Restoring states from the checkpoint path" in proc.stderr + proc.stdout


def test_hf_trainer_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="install the test extra: pip install -e '.[test]'")
    proc, recs = run("hf_job.py", tmp_path, "sigkill")
    check_resumed(proc, recs)
    saved = {p.name for p in (tmp_path / "hf_out").iterdir()}
    assert saved == {f"checkpoint-{s}" for s in range(CKPT_EVERY, STEPS + 1, CKPT_EVERY)}
