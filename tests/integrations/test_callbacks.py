"""The framework callbacks feed the launcher's progress slots and the run's event log.

Real frameworks, in this process, on CPU; each framework's test skips when it is not
installed (they are optional).  The launcher's side is a real ProgressBoard and a real
events file, as `stalwart run` sets them up.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart import progress, runlog
from stalwart.integrations import Reporter
from stalwart.monitor import envvars
from stalwart.progress import ProgressBoard

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def launcher_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[ProgressBoard, Path]]:
    board = ProgressBoard(tmp_path, 1)
    events = tmp_path / "events.jsonl"
    events.touch()
    for key, value in board.worker_env(0).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(runlog.EVENTS_FILE_ENV, str(events))
    monkeypatch.delenv(envvars.SHM_FILE, raising=False)
    progress.reset()
    yield board, events
    progress.reset()
    board.close()


def commits(events: Path) -> list[int]:
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    return [e["step"] for e in lines if e["event"] == runlog.CHECKPOINT_COMMIT]


def test_reporter_feeds_progress_and_commits(launcher_side: tuple[ProgressBoard, Path]) -> None:
    board, events = launcher_side
    r = Reporter()
    r.start()  # no monitor segment named: no client, no warning
    for s in (3, 4, 5):
        r.step(s)
    sample = board.read()[0]
    assert (sample.first_step, sample.step) == (3, 5) and sample.at >= sample.first_at
    r.checkpoint_saved(5, "/ckpt/5")
    r.stop()
    assert commits(events) == [5]


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning not installed")
def test_lightning_callback(launcher_side: tuple[ProgressBoard, Path], tmp_path: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from stalwart.integrations import StalwartCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)
    trainer = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[
            StalwartCallback(),
            pl.callbacks.ModelCheckpoint(
                dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1
            ),
        ],
    )
    trainer.fit(Tiny(), data)
    board, events = launcher_side
    sample = board.read()[0]
    assert (sample.first_step, sample.step) == (0, 5)
    assert commits(events) == [2, 4, 6]


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("accelerate") is None,
    reason="transformers/accelerate not installed",
)
def test_transformers_callback(launcher_side: tuple[ProgressBoard, Path], tmp_path: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from stalwart.integrations import StalwartTrainerCallback

    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    )
    ids = torch.randint(0, 64, (16, 8))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    Trainer(
        model=model, args=args, train_dataset=data, callbacks=[StalwartTrainerCallback()]
    ).train()
    board, events = launcher_side
    sample = board.read()[0]
    assert (sample.first_step, sample.step) == (0, 3)
    assert commits(events) == [2, 4]
    assert (tmp_path / "out" / "checkpoint-4").is_dir()


def test_monitor_client_iterations_feed_progress(launcher_side: tuple[ProgressBoard, Path]) -> None:
    from stalwart.monitor import RankMonitorClient

    board, _ = launcher_side
    client = RankMonitorClient()
    client.init_workload_monitoring()
    client.report_iteration(11)
    client.report_iteration(12)
    client.shutdown_workload_monitoring()
    sample = board.read()[0]
    assert (sample.first_step, sample.step) == (11, 12)
