"""A Lightning ``Trainer`` and a transformers ``Trainer`` job that never import stalwart
(``progress_jobs/``), under ``stalwart run`` with no timeout configured: a rank stopped,
asleep in the program's own callback, or stuck in its Dataset is found from the rhythm
of its optimizer steps, blamed on evidence (the stopped or non-waiting rank, never its
peer in a collective), and the job resumes from the framework's checkpoint and finishes.
A healthy run with validation passes is never killed (issue 22)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, clean_env, events, stalwart_argv

JOBS = Path(__file__).parent / "progress_jobs"
STEPS = 40

pytestmark = pytest.mark.timeout(240)


def run(
    script: str, work: Path, fault: str, **pj: str
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]], list[dict[str, Any]]]:
    env = clean_env(
        PJ_WORK=str(work), PJ_FAULT=fault, PJ_STEPS=str(STEPS), HF_HOME=str(work / "hf"), **pj
    )
    proc = subprocess.run(
        stalwart_argv(
            "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", work / "logs",
            JOBS / script,
        ),
        capture_output=True, text=True, timeout=230, env=env, cwd=ROOT,
    )  # fmt: skip
    p = work / "p.jsonl"
    recs = [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []
    return proc, recs, events(work / "logs")


@pytest.mark.parametrize(
    ("script", "fault", "why"),
    [
        ("lightning_plain.py", "stop:1:25", "stopped"),
        ("lightning_plain.py", "sleep:1:25", "on_train_batch_end"),
        ("hf_plain.py", "sleep:1:25", "on_step_end"),
        ("hf_plain.py", "loader:1:25", "__getitem__"),
    ],
)
def test_framework_hang_found_blamed_resumed_without_any_timeout(
    tmp_path: Path, script: str, fault: str, why: str
) -> None:
    pytest.importorskip("lightning" if script.startswith("lightning") else "transformers")
    proc, recs, evs = run(script, tmp_path, fault)
    assert proc.returncode == 0, proc.stderr[-4000:]
    hangs = [e for e in evs if e["event"] == "hang_detected"]
    roots = [h for h in hangs if h["waiting_on"] is None]
    assert [h["global_rank"] for h in roots] == [1], hangs
    assert why in roots[0]["evidence"], roots[0]
    # Detected from the learned rhythm, not a 60 s fallback.
    assert roots[0]["timeout"] < 30, roots[0]
    # The verdict made at detection is the one reported, whatever exit code the stopped
    # rank's framework chose after the terminate signal.
    restart = next(e for e in evs if e["event"] == "restart")
    assert restart["root_cause"]["rank"] == 1, restart
    assert [r["attempt"] for r in recs if r["event"] == "start"] == [0, 1]
    assert recs[-1]["attempt"] == 1 and recs[-1]["step"] == STEPS, recs[-1]


def test_lightning_with_validation_passes_is_never_killed(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    # A validation pass of 10 batches x 0.05 s (tens of steps long) every 8 steps and a
    # checkpoint every 10.
    proc, recs, evs = run("lightning_plain.py", tmp_path, "none:0:0", PJ_EVAL="8")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not [e for e in evs if e["event"] in ("hang_detected", "restart")]
    assert [r["attempt"] for r in recs if r["event"] == "start"] == [0]
