"""Lightning: ``Trainer(callbacks=[StalwartCallback()])``."""

from __future__ import annotations

from typing import Any

from stalwart.integrations._core import Reporter

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    try:
        from pytorch_lightning import Callback  # type: ignore[assignment,unused-ignore]
    except ImportError:
        raise ImportError(
            "stalwart.integrations.lightning needs Lightning: pip install lightning"
        ) from None


class StalwartCallback(Callback):  # type: ignore[misc,unused-ignore]
    """Heartbeat and step at each training batch; a checkpoint save is recorded once
    Lightning has written it (it saves synchronously, so by the next batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.reporter = Reporter()
        self._saved: int | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.reporter.start()

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._flush_save()
        self.reporter.step(int(trainer.global_step))

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._saved = int(trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._flush_save()
        self.reporter.stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.reporter.stop()

    def _flush_save(self) -> None:
        if self._saved is not None:
            self.reporter.checkpoint_saved(self._saved)
            self._saved = None
