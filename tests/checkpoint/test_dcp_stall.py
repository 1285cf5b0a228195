"""What the training loop waits for in an asynchronous DCP save through stalwart: the
call queues the save and returns; the walk over the state dict, the staging copy and the
upload run on threads the saver already has. One process, no process group."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stalwart.checkpoint import dcp as sdcp
from stalwart.checkpoint.dcp_stager import ReusingStager

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


class _Watched(dict[str, Any]):
    """A state dict that records which threads walk it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.walkers: set[int] = set()

    def items(self) -> Any:
        self.walkers.add(threading.get_ident())
        return super().items()


class _Position:
    """A data loader's position: DCP's ``Stateful`` protocol."""

    def __init__(self) -> None:
        self.batch = 0

    def state_dict(self) -> dict[str, Any]:
        return {"batch": torch.tensor(self.batch)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.batch = int(sd["batch"])


def test_staging_walks_the_state_dict_off_the_callers_thread() -> None:
    stager = ReusingStager()
    try:
        inner = _Watched({"x": torch.arange(7.0)})
        state = _Watched({"w": torch.arange(4096.0), "b": inner, "n": 3})
        fut = stager.stage(state)
        assert not isinstance(fut, dict)
        staged = fut.result(timeout=30)
        me = threading.get_ident()
        assert state.walkers and me not in state.walkers | inner.walkers
        assert torch.equal(staged["w"], state["w"]) and staged["w"] is not state["w"]
        assert torch.equal(staged["b"]["x"], inner["x"]) and staged["n"] == 3
        assert stager.staged_bytes.result(timeout=1) == (4096 + 7) * 4
    finally:
        stager.close()


def test_the_saver_starts_no_thread_per_save_and_takes_stateful_state_at_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sharded = sdcp.ShardedSaves(tmp_path / "sharded", keep_last=2, rank=0, segment=None)
    saver = sdcp.AsyncDcpSaver(tmp_path, keep_last=2, subprocess=False, ram=False)
    try:
        pos = _Position()
        state: dict[str, Any] = {"w": torch.zeros(1024), "pos": pos}
        saver.save(state, 1)[1].result(timeout=30)  # its thread starts with the first save
        started: list[str] = []
        real_start = threading.Thread.start

        def counting(self: threading.Thread) -> None:
            started.append(self.name)
            real_start(self)

        monkeypatch.setattr(threading.Thread, "start", counting)
        for step in (2, 3, 4):
            state["w"].fill_(float(step))
            pos.batch = step
            staged, done = saver.save(state, step)
            pos.batch = -1  # after the call: not part of this step
            staged.result(timeout=30)
            done.result(timeout=30)
        monkeypatch.undo()
        # dcp.async_save starts a thread for every call (its executor).
        assert started == []
        result = sharded.save({"w": torch.ones(1000), "b": torch.ones(24)}, 7).result(timeout=30)
        assert result.nbytes == 1024 * 4
    finally:
        saver.close()
        sharded.close()
    target: dict[str, Any] = {"w": torch.zeros(1024), "pos": _Position()}
    dcp.load(target, checkpoint_id=tmp_path / "step_000000004")
    assert torch.equal(target["w"], torch.full((1024,), 4.0)) and target["pos"].batch == 4


def test_a_saver_refuses_a_group_without_a_cpu_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its save runs on a thread of its own: on the loop's NCCL group (mocked: no GPU
    here) the collectives would interleave with the loop's. One clear error, at once."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match=r"a 'nccl' group; expected one with a CPU backend"):
        sdcp.AsyncDcpSaver(tmp_path, process_group=object(), subprocess=False, ram=False)
    assert list(tmp_path.iterdir()) == []
