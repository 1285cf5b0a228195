# A transformers Trainer job as a user writes it for torchrun: a tiny GPT-2 from a config
# (random weights, no download), no stalwart import, no __main__ guard. PJ_* knobs as in
# bench/plain_ddp_job.py: PJ_FAULT kind:rank:step (sleep in the program's own callback, stop,
# loader), PJ_CKPT (save_steps).
import json
import os
import signal
import time

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

work = os.environ["PJ_WORK"]
steps = int(os.environ.get("PJ_STEPS", "40"))
kind, frank, fstep = os.environ.get("PJ_FAULT", "none:0:0").split(":")[:3]
every_ckpt = int(os.environ.get("PJ_CKPT", "10"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = int(os.environ["RANK"])
faulty = attempt == 0 and rank == int(frank) and kind != "none"
seen = {"step": 0}


class Tokens(Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        if faulty and kind == "loader" and seen["step"] >= int(fstep):
            while True:
                time.sleep(3600)
        ids = torch.randint(0, 128, (32,))
        return {"input_ids": ids, "labels": ids}


class Record(TrainerCallback):
    def _write(self, event, step):
        if rank == 0:
            with open(os.path.join(work, "p.jsonl"), "a") as f:
                f.write(
                    json.dumps(
                        {"event": event, "attempt": attempt, "step": step, "time": time.time()}
                    )
                    + "\n"
                )

    def on_train_begin(self, args, state, control, **kw):
        seen["step"] = state.global_step
        self._write("start", state.global_step)

    def on_step_end(self, args, state, control, **kw):
        seen["step"] = state.global_step
        self._write("step", state.global_step)
        if faulty and state.global_step == int(fstep):
            if kind == "sleep":
                while True:
                    time.sleep(3600)
            if kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)


config = GPT2Config(
    vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
)
out = os.path.join(work, "hf_out")
args = TrainingArguments(
    output_dir=out,
    max_steps=steps,
    save_strategy="steps",
    save_steps=every_ckpt,
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
    model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(), callbacks=[Record()]
)
trainer.train(resume_from_checkpoint=get_last_checkpoint(out) if os.path.isdir(out) else None)
