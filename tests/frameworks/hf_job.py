"""A transformers ``Trainer`` job as a user would write it for torchrun: a tiny GPT-2
built from a config (no download: random weights, synthetic token ids, offline), DDP on
CPU (gloo), checkpoints by ``save_steps`` and resumption by ``resume_from_checkpoint``.

    python hf_job.py WORK STEPS CKPT_EVERY [PAUSE_S [PAUSE_STEPS]]

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

# Never reach the network, whatever the caller's environment says.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"

import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

from stalwart import inject

VOCAB, SEQ = 128, 32


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Token ids from a seeded generator: a language-modelling batch without a tokenizer."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Progress(TrainerCallback):
    def __init__(self, path: Path, pause: float = 0.0, pause_steps: int | None = None) -> None:
        self.path = path
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.pause = pause if self.attempt == 0 else 0.0
        self.pause_steps = pause_steps
        self.rank = int(os.environ.get("RANK", "0"))

    def _write(self, event: str, step: int) -> None:
        if self.rank == 0:
            rec = {"event": event, "attempt": self.attempt, "step": step, "time": time.time()}
            with open(self.path, "a") as fh:
                fh.write(json.dumps(rec) + "\n")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._write("start", state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.pause_steps is None or state.global_step <= self.pause_steps:
            time.sleep(self.pause)
        self._write("step", state.global_step)
        inject.step(state.global_step)


def main() -> None:
    work, steps, every = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    pause_steps = int(sys.argv[5]) if len(sys.argv) > 5 else None
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    out = work / "hf_out"
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        save_strategy="steps",
        save_steps=every,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(512),
        callbacks=[Progress(work / "p.jsonl", pause, pause_steps)],
    )
    last = get_last_checkpoint(str(out)) if out.is_dir() else None
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main()
