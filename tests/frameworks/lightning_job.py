"""A Lightning 2.6 job as a user would write it for torchrun: ``Trainer`` with the DDP
strategy on CPU (gloo), one process per rank started by the launcher, checkpoints by
``ModelCheckpoint`` and resumption by ``ckpt_path="last"``.

    python lightning_job.py WORK STEPS CKPT_EVERY [PAUSE_S [PAUSE_STEPS]]

Faults come from ``STALWART_INJECT`` (``stalwart.inject.step`` at the end of each
step, global step numbering).  Rank 0 appends one JSON line per event to WORK/p.jsonl:
``{"event": "start"|"step", "attempt", "step", "time"}``; "start" carries the global
step training (re)started from.  PAUSE_S (default 0) makes each step of the first
attempt last that much longer (a sleep before its record), so that a fault comes after
seconds of training, as real ones do (the benchmark uses it); later attempts do not
pause, so the first resumed step is timed as it is.  PAUSE_STEPS (default: every step)
limits the pause to the first that many steps, so that the steps before a later fault
run at the job's own rate (the benchmark's "back at full speed" compares with it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from stalwart import inject


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Progress(Callback):
    def __init__(self, path: Path, pause: float = 0.0, pause_steps: int | None = None) -> None:
        self.path = path
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.pause = pause if self.attempt == 0 else 0.0
        self.pause_steps = pause_steps

    def _write(self, trainer: L.Trainer, event: str) -> None:
        if trainer.global_rank == 0:
            rec = {
                "event": event,
                "attempt": self.attempt,
                "step": trainer.global_step,
                "time": time.time(),
            }
            with open(self.path, "a") as fh:
                fh.write(json.dumps(rec) + "\n")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "start")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        # global_step counts finished optimizer steps: the first step is 1.
        if self.pause_steps is None or trainer.global_step <= self.pause_steps:
            time.sleep(self.pause)
        self._write(trainer, "step")
        inject.step(trainer.global_step)


def main() -> None:
    work, steps, every = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    pause_steps = int(sys.argv[5]) if len(sys.argv) > 5 else None
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 16, generator=gen), torch.randn(4096, 1, generator=gen))
    ckpt = ModelCheckpoint(
        dirpath=work / "ckpt", save_last=True, every_n_train_steps=every, save_top_k=0
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="ddp",
        max_steps=steps,
        callbacks=[ckpt, Progress(work / "p.jsonl", pause, pause_steps)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=8), ckpt_path="last")


if __name__ == "__main__":
    main()
