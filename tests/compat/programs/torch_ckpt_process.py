"""A program written for torch's experimental checkpoint process, as its source and
docs show it: a writer class taking ``rank_info`` in its init and ``write(path,
state_dict, **kwargs)``, torch's own ``CheckpointWriter``, failures caught as
``RuntimeError``. The test swaps only the marked import lines for stalwart's."""

# ruff: noqa: I001  (the swapped lines stay single lines, where the test finds them)

import os
import sys
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint._experimental.checkpoint_writer import (
    CheckpointWriter,
    CheckpointWriterConfig,
)

# fmt: off
from torch.distributed.checkpoint._experimental.checkpoint_process import CheckpointProcess, CheckpointProcessConfig  # IMPORT-LINE
from torch.distributed.checkpoint._experimental.types import RankInfo  # IMPORT-LINE-2
# fmt: on


class TaggingWriter:
    """A user's writer: records who wrote what, with which keyword arguments."""

    def __init__(self, out_dir: str, rank_info: RankInfo) -> None:
        self.out_dir = out_dir
        self.rank_info = rank_info

    def write(self, path: str, state_dict: dict[str, Any], **kwargs: Any) -> Future[None] | None:
        if kwargs.get("fail"):
            raise ValueError("refusing this write on purpose")
        os.makedirs(path, exist_ok=True)
        record = {
            "state_dict": state_dict,
            "kwargs": kwargs,
            "rank": self.rank_info.global_rank,
            "world_size": self.rank_info.global_world_size,
        }
        torch.save(record, os.path.join(path, f"tagged_{self.rank_info.global_rank}.pt"))
        return None


def init_subprocess(tag: str) -> None:
    os.environ["CKPT_SUBPROCESS_TAG"] = tag


def main() -> None:
    out = sys.argv[1]
    rank_info = RankInfo(
        global_rank=int(os.environ.get("RANK", "0")),
        global_world_size=int(os.environ.get("WORLD_SIZE", "1")),
    )
    rank = rank_info.global_rank
    state = {"w": torch.arange(6, dtype=torch.float32) + rank, "step": 3}

    proc = CheckpointProcess(
        rank_info=rank_info,
        config=CheckpointProcessConfig(subprocess_init_timeout_secs=120),
        subprocess_init_fn=init_subprocess,
        subprocess_init_args=("compat",),
        checkpoint_writer_init_fn=TaggingWriter,
        checkpoint_writer_init_args={"out_dir": out},
    )
    fut = proc.write(state, os.path.join(out, "step_3"), epoch=7)
    assert fut is not None
    fut.result()
    try:
        failing = proc.write(state, os.path.join(out, "step_4"), fail=True)
        assert failing is not None
        failing.result()
    except RuntimeError as exc:
        print(f"rank {rank}: caught RuntimeError: {'refusing this write' in str(exc)}", flush=True)
    proc.close()

    # torch's own writer class, run by the same process class.
    proc = CheckpointProcess(
        rank_info,
        CheckpointProcessConfig(subprocess_init_timeout_secs=120),
        init_subprocess,
        ("compat",),
        CheckpointWriter,
        {"config": CheckpointWriterConfig()},
    )
    fut = proc.write(state, os.path.join(out, "step_5"))
    assert fut is not None
    fut.result()
    proc.close()
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
