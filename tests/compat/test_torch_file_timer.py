"""torch's FileTimerClient, used exactly as torch's docs show, under `stalwart run`
(issue 12 item 5): a signal <= 0 observes an expiry and never reaps; with its default
signal the worker is reaped and the job restarts."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, clean_env, read_events, stalwart_argv

pytest.importorskip("torch")


# A training script written for torchrun with TORCHELASTIC_ENABLE_FILE_TIMER=1.
SCRIPT = """
import os, sys, time
import torch.distributed.elastic.timer as timer

signal = int(sys.argv[1])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
client = (
    timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"], signal=signal)
    if signal >= 0
    else timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"])
)
timer.configure(client)
with timer.expires(after=0.5 if restart == 0 else 30, scope="train_step"):
    time.sleep(2.5 if restart == 0 else 0.1)
print("finished step", flush=True)
"""


def run(
    tmp_path: Path, signal: int
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = clean_env(TORCHELASTIC_ENABLE_FILE_TIMER="1")
    logs = tmp_path / "logs"
    run_id = f"torch-timer-{signal if signal >= 0 else 'default'}"
    proc = subprocess.run(
        stalwart_argv("--nproc-per-node", "1",
         "--max-restarts", "1", "--rdzv-id", run_id, "--log-dir", logs,
         script, str(signal)),
        capture_output=True, text=True, timeout=100, env=env, cwd=ROOT,
    )  # fmt: skip
    events_file = logs / run_id / "events.jsonl"
    assert events_file.exists(), proc.stderr[-3000:]
    return proc, read_events(events_file)


@pytest.mark.timeout(120)
def test_signal_zero_observes_and_never_reaps(tmp_path: Path) -> None:
    proc, events = run(tmp_path, 0)
    names = [e["event"] for e in events]
    assert proc.returncode == 0, (names, proc.stderr[-3000:])
    expired = [e for e in events if e["event"] == "timer_expired"]
    assert expired and expired[0]["scope"] == "train_step" and expired[0]["reaped"] is False
    assert "hang_detected" not in names and "restart" not in names


@pytest.mark.timeout(120)
def test_default_signal_reaps_and_the_job_restarts(tmp_path: Path) -> None:
    proc, events = run(tmp_path, -1)  # -1: FileTimerClient's own default signal
    names = [e["event"] for e in events]
    assert proc.returncode == 0, (names, proc.stderr[-3000:])
    (hang,) = [e for e in events if e["event"] == "hang_detected"]
    assert hang["kind"] == "timer" and hang["section"] == "train_step"
    assert names.index("hang_detected") < names.index("restart")
