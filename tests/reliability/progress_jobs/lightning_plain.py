# A Lightning 2.6 job as a user writes it for torchrun: no stalwart import, no __main__
# guard. PJ_* knobs as in bench/plain_ddp_job.py: PJ_FAULT kind:rank:step (sleep in the program's
# own callback before the next step's collective, stop, loader), PJ_EVAL (a validation
# pass 10x a step long every N steps), PJ_CKPT (ModelCheckpoint every N steps).
import json
import os
import signal
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

work = os.environ["PJ_WORK"]
steps = int(os.environ.get("PJ_STEPS", "40"))
kind, frank, fstep = os.environ.get("PJ_FAULT", "none:0:0").split(":")[:3]
every_eval = int(os.environ.get("PJ_EVAL", "0"))
every_ckpt = int(os.environ.get("PJ_CKPT", "10"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = int(os.environ["RANK"])
faulty = attempt == 0 and rank == int(frank) and kind != "none"
seen = {"step": 0}


class Numbers(Dataset):
    def __len__(self):
        return 10**6

    def __getitem__(self, i):
        if faulty and kind == "loader" and seen["step"] >= int(fstep):
            while True:
                time.sleep(3600)
        return torch.randn(16), torch.randn(1)


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.05:
            self.net(torch.randn(256, 16))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Record(Callback):
    def on_train_start(self, trainer, module):
        seen["step"] = trainer.global_step
        if rank == 0:
            with open(os.path.join(work, "p.jsonl"), "a") as f:
                f.write(
                    json.dumps(
                        {
                            "event": "start",
                            "attempt": attempt,
                            "step": trainer.global_step,
                            "time": time.time(),
                        }
                    )
                    + "\n"
                )

    def on_train_batch_end(self, trainer, *args):
        seen["step"] = trainer.global_step
        if rank == 0:
            with open(os.path.join(work, "p.jsonl"), "a") as f:
                f.write(
                    json.dumps(
                        {
                            "event": "step",
                            "attempt": attempt,
                            "step": trainer.global_step,
                            "time": time.time(),
                        }
                    )
                    + "\n"
                )
        if faulty and trainer.global_step == int(fstep):
            if kind == "sleep":
                while True:
                    time.sleep(3600)
            if kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)


trainer = L.Trainer(
    accelerator="cpu",
    devices=int(os.environ["LOCAL_WORLD_SIZE"]),
    strategy="ddp",
    max_steps=steps,
    callbacks=[
        ModelCheckpoint(
            dirpath=os.path.join(work, "ckpt"),
            save_last=True,
            every_n_train_steps=every_ckpt,
            save_top_k=0,
        ),
        Record(),
    ],
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    val_check_interval=every_eval if every_eval else None,
    limit_val_batches=10 if every_eval else 0,
    num_sanity_val_steps=0,
)
trainer.fit(
    Tiny(),
    DataLoader(Numbers(), batch_size=8),
    DataLoader(Numbers(), batch_size=8) if every_eval else None,
    ckpt_path="last",
)
