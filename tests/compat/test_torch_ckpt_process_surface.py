"""What torch's own tests of its experimental checkpoint process rely on and callers
use: ``process_creation_future`` to wait for the writer child, and a start timeout
whose message begins with "Timed out".  See docs/migrating.md."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from stalwart.checkpoint import CheckpointProcess, CheckpointProcessConfig, RankInfo

pytestmark = pytest.mark.timeout(60)


def _check_child(expected_parent: int) -> None:
    if os.getppid() != expected_parent:
        raise RuntimeError(f"init ran under {os.getppid()}, not {expected_parent}")


def _slow_child() -> None:
    time.sleep(5)


class _SaveWriter:
    def __init__(self, rank_info: RankInfo) -> None:
        self.rank = rank_info.global_rank

    def write(self, path: str, state_dict: dict[str, torch.Tensor]) -> None:
        os.makedirs(path, exist_ok=True)
        torch.save(state_dict, os.path.join(path, f"part_{self.rank}.pt"))


def _make_writer(**kwargs: object) -> _SaveWriter:
    rank_info = kwargs["rank_info"]
    assert isinstance(rank_info, RankInfo)
    return _SaveWriter(rank_info)


def _process(init: object, init_args: tuple[object, ...], init_timeout: int) -> CheckpointProcess:
    return CheckpointProcess(
        rank_info=RankInfo(global_world_size=1, global_rank=0),
        config=CheckpointProcessConfig(subprocess_init_timeout_secs=init_timeout),
        subprocess_init_fn=init,
        subprocess_init_args=init_args,
        checkpoint_writer_init_fn=_make_writer,
        checkpoint_writer_init_args={},
    )


def test_process_creation_future_is_waited_on_before_writing(tmp_path: Path) -> None:
    proc = _process(_check_child, (os.getpid(),), 30)
    try:
        ready = proc.process_creation_future
        assert isinstance(ready, Future)
        assert ready.result(timeout=30) is None
        proc.write({"w": torch.arange(4.0)}, str(tmp_path / "ckpt")).result(timeout=30)
    finally:
        proc.close()
    saved = torch.load(tmp_path / "ckpt" / "part_0.pt", weights_only=True)
    assert torch.equal(saved["w"], torch.arange(4.0))


def test_start_timeout_says_timed_out() -> None:
    proc = _process(_slow_child, (), 1)
    try:
        with pytest.raises(TimeoutError, match=r"^Timed out"):
            proc.process_creation_future.result(timeout=30)
    finally:
        proc.close()
