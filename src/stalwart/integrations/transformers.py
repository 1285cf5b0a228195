"""HF Trainer: ``Trainer(..., callbacks=[StalwartTrainerCallback()])``."""

from __future__ import annotations

import os
from typing import Any

from stalwart.integrations._core import Reporter

try:
    from transformers import TrainerCallback
except ImportError:
    raise ImportError(
        "stalwart.integrations.transformers needs transformers: pip install transformers"
    ) from None


class StalwartTrainerCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]
    """Heartbeat and step at each optimizer step; ``on_save`` comes after the Trainer
    wrote ``checkpoint-<step>``, so it is recorded as committed."""

    def __init__(self) -> None:
        self.reporter = Reporter()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.reporter.start()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.reporter.step(int(state.global_step))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")
        self.reporter.checkpoint_saved(int(state.global_step), folder)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.reporter.stop()
