"""Under `stalwart run` a committed save is written to the run's event log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stalwart import runlog
from stalwart.checkpoint import AsyncCheckpointer

pytestmark = pytest.mark.timeout(120)


def test_commit_is_recorded_in_the_run_event_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = tmp_path / "events.jsonl"
    events.touch()
    monkeypatch.setenv(runlog.EVENTS_FILE_ENV, str(events))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("RANK", "0")
    with AsyncCheckpointer(tmp_path / "ckpt", keep_last=2, rank=0, world_size=1) as ckpt:
        ckpt.save({"w": torch.ones(16)}, step=7).result(timeout=60)
        ckpt.save({"w": torch.ones(16)}, step=8).result(timeout=60)
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    assert [(e["event"], e["step"], e["attempt"], e["rank"]) for e in lines] == [
        (runlog.CHECKPOINT_COMMIT, 7, 2, 0),
        (runlog.CHECKPOINT_COMMIT, 8, 2, 0),
    ]
    assert all(e["source"] == "worker" and e["stall_s"] >= 0 for e in lines)


def test_no_event_file_no_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runlog.EVENTS_FILE_ENV, raising=False)
    assert runlog.emit(runlog.CHECKPOINT_COMMIT, step=1) is False
    # A named file that is gone is never created: no leftover file in a stale folder.
    monkeypatch.setenv(runlog.EVENTS_FILE_ENV, str(tmp_path / "gone" / "events.jsonl"))
    assert runlog.emit(runlog.CHECKPOINT_COMMIT, step=1) is False
    assert not (tmp_path / "gone").exists()
