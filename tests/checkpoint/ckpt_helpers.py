"""Functions and classes the checkpoint tests hand to spawned writer children.

They live in an importable module (not in a test file) because the spawned
child imports them by name.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Custom:
    """A user-defined object, only loadable with weights_only=False."""

    name: str
    values: list[int]


def sleep_forever() -> None:
    while True:
        time.sleep(3600)


def fail_init(reason: str) -> None:
    raise RuntimeError(f"init refused: {reason}")


class ScriptedWriter:
    """A writer whose behaviour each write chooses through ``mode``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.stuck_housekeeping = False

    def housekeeping(self) -> None:
        # Lets a test keep the child busy after it reported a write done.
        while self.stuck_housekeeping:
            time.sleep(3600)

    def write(
        self, state_dict: Any, path: str, *, release: Callable[[], None], **kwargs: Any
    ) -> Any:
        mode = kwargs.get("mode", "ok")
        if mode == "raise":
            raise ValueError("scripted failure inside the writer")
        if mode == "exit":
            os._exit(17)
        if mode == "hang":
            time.sleep(3600)
        if mode == "stuck_after":
            self.stuck_housekeeping = True
        torch.save(state_dict, self.out_dir / path)
        release()
        return {"pid": os.getpid(), "path": path}


def make_state(seed: int, mib: float = 0.25) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    n = int(mib * (1 << 20) / 4)
    return {"w": torch.randn(n, generator=g), "step": seed}


def remount_read_only(path: Path) -> bool:
    """Flip a bind mount to read-only; False if the kernel refused."""
    res = subprocess.run(
        ["mount", "-o", "remount,ro,bind", str(path)], capture_output=True, check=False
    )
    return res.returncode == 0
