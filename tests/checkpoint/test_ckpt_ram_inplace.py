"""Restoring into the caller's tensors (``restore(into=...)``), from RAM and from disk.

Real segments made by the launcher's own class, a real model and optimizer, a real
TCPStore between two ranks (threads of this process) for the collective failure path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch._C._distributed_c10d import TCPStore

from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig, restore
from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint.inplace import StateMismatchError, bind, key_path
from stalwart.checkpoint.ram import RamSegment, find_snapshots
from stalwart.checkpoint.staging import plan
from stalwart.launch.replicas.snapshots import SnapshotMemory

pytestmark = pytest.mark.timeout(120)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}


def _snapshot(mem: SnapshotMemory, state: Any, step: int) -> None:
    seg = RamSegment.open(mem.folder / rl.segment_name(0))
    try:
        seg.write(plan(state), step, rank=0, world_size=1)
    finally:
        seg.close()


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return type(state)((k, _clone(v)) for k, v in state.items())
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


def _scramble(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
        for s in opt.state.values():
            for v in s.values():
                v.fill_(7.0)


def test_restore_into_the_model_and_optimizer_copies_in_place(
    memory: SnapshotMemory, tmp_path: Path
) -> None:
    model, opt = _model()
    saved = _clone(_state(model, opt))
    _snapshot(memory, _state(model, opt), 5)
    _scramble(model, opt)
    into = _state(model, opt)
    ptrs = {k: p.data_ptr() for k, p in model.named_parameters()}

    found = restore(tmp_path / "ck", rank=0, world_size=1, into=into)

    assert found is not None and (found.step, found.source) == (5, "ram")
    for k, p in model.named_parameters():
        assert p.data_ptr() == ptrs[k]  # the very parameters, not new memory
        assert torch.equal(p, saved["model"][k])
        assert found.state_dict["model"][k] is into["model"][k]
    for i, s in opt.state_dict()["state"].items():
        for name, v in s.items():
            assert torch.equal(v, saved["optim"]["state"][i][name])
            assert found.state_dict["optim"]["state"][i][name] is v
    assert found.state_dict["epoch"] == 3
    # What the caller does next: load_state_dict accepts it as it is.
    model.load_state_dict(found.state_dict["model"])
    opt.load_state_dict(found.state_dict["optim"])
    model(torch.randn(4, 64)).sum().backward()
    opt.step()


def test_restore_into_fills_what_it_has_and_allocates_the_rest(
    memory: SnapshotMemory, tmp_path: Path
) -> None:
    model, opt = _model()
    saved = _clone(_state(model, opt))
    _snapshot(memory, _state(model, opt), 2)
    # A fresh optimizer has no state yet: its moments come back as new tensors.
    fresh_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _scramble(model, opt)
    into = {"model": model.state_dict(), "optim": fresh_opt.state_dict()}
    found = restore(tmp_path / "ck", rank=0, world_size=1, into=into)
    assert found is not None
    assert torch.equal(model[0].weight, saved["model"]["0.weight"])
    moments = found.state_dict["optim"]["state"][0]
    assert torch.equal(moments["exp_avg"], saved["optim"]["state"][0]["exp_avg"])
    fresh_opt.load_state_dict(found.state_dict["optim"])
    assert torch.equal(fresh_opt.state[model[0].weight]["exp_avg"], moments["exp_avg"])
    # Fresh ones are the restorer's own memory: a later snapshot does not change them.
    before = moments["exp_avg"].clone()
    _snapshot(memory, {"other": torch.zeros(1 << 20)}, 3)
    _snapshot(memory, {"other": torch.zeros(1 << 20)}, 4)
    assert torch.equal(moments["exp_avg"], before)


def test_a_mismatched_shape_is_one_line_naming_the_key_and_copies_nothing(
    memory: SnapshotMemory, tmp_path: Path
) -> None:
    model, opt = _model()
    _snapshot(memory, _state(model, opt), 5)
    _scramble(model, opt)
    other = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 9))
    with torch.no_grad():
        for p in other.parameters():
            p.fill_(7.0)
    into = {"model": other.state_dict()}
    with pytest.raises(StateMismatchError) as err:
        restore(tmp_path / "ck", rank=0, world_size=1, into=into)
    msg = str(err.value)
    assert "\n" not in msg
    assert "['model']['1.weight']" in msg and "(8, 32)" in msg and "(9, 32)" in msg
    # Checked before any copy: even the layer that fits is untouched.
    assert all(bool((p == 7.0).all()) for p in other.parameters())


def test_a_torn_newest_snapshot_never_reaches_the_callers_tensors(
    memory: SnapshotMemory, tmp_path: Path
) -> None:
    _snapshot(memory, {"w": torch.full((1 << 16,), 4.0)}, 4)
    _snapshot(memory, {"w": torch.full((1 << 16,), 5.0)}, 5)
    snap = find_snapshots(memory.folder, 0, 1)[0]
    assert snap.step == 5
    at = (
        rl.data_offset(snap.slot, rl.slot_capacity(snap.path.stat().st_size))
        + snap.record.tensor_offset
        + 100
    )
    with open(snap.path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    w = torch.zeros(1 << 16)
    found = restore(tmp_path / "ck", rank=0, world_size=1, into={"w": w})
    assert found is not None and found.step == 4 and found.state_dict["w"] is w
    assert torch.equal(w, torch.full((1 << 16,), 4.0))
    # Both slots torn, nothing on disk: None, and the caller's tensor is as it was.
    older = find_snapshots(memory.folder, 0, 1)[1]
    at = (
        rl.data_offset(older.slot, rl.slot_capacity(older.path.stat().st_size))
        + older.record.tensor_offset
    )
    with open(older.path, "r+b") as f:
        f.seek(at)
        f.write(b"\xff" * 8)
    w2 = torch.full((1 << 16,), -1.0)
    assert restore(tmp_path / "ck", rank=0, world_size=1, into={"w": w2}) is None
    assert bool((w2 == -1.0).all())


def test_restore_into_from_disk_when_the_snapshots_are_gone(
    memory: SnapshotMemory, tmp_path: Path
) -> None:
    model, opt = _model()
    saved = _clone(_state(model, opt))
    with AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1) as ck:
        ck.save(_state(model, opt), 9).result(timeout=60)
    memory.close()  # what the guardian does after a launcher SIGKILL
    _scramble(model, opt)
    into = _state(model, opt)
    found = restore(tmp_path / "ck", rank=0, world_size=1, into=into)
    assert found is not None and (found.step, found.source) == (9, "disk")
    assert found.state_dict["model"]["0.weight"] is into["model"]["0.weight"]
    assert torch.equal(model[0].weight, saved["model"]["0.weight"])
    assert torch.equal(
        opt.state[model[1].bias]["exp_avg_sq"], saved["optim"]["state"][3]["exp_avg_sq"]
    )


def test_the_checkpointer_restores_into_from_its_own_mapping(
    memory: SnapshotMemory, tmp_path: Path
) -> None:
    model, opt = _model()
    saved = _clone(model.state_dict())
    with AsyncCheckpointer(
        tmp_path / "ck", rank=0, world_size=1, config=CheckpointerConfig(persist_every=100)
    ) as ck:
        ck.save(_state(model, opt), 1)
        _scramble(model, opt)
        found = ck.restore(into=_state(model, opt))
    assert found is not None and (found.step, found.source) == (1, "ram")
    for k, p in model.state_dict().items():
        assert torch.equal(p, saved[k])


_RANK = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    import torch
    from torch._C._distributed_c10d import TCPStore
    from stalwart.checkpoint import restore
    from stalwart.checkpoint.inplace import StateMismatchError
    ck, port, rank, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    store = TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    for size in (n, 10):  # the size given, then one that fits
        w = torch.zeros(size)
        try:
            found = restore(ck, rank=rank, world_size=2, store=store, into={"w": w}, timeout_s=30)
            out = {"step": found.step, "same": found.state_dict["w"] is w, "w": w.tolist()}
        except StateMismatchError as exc:
            out = {"error": str(exc), "w": w.tolist()}
        print(json.dumps(out))
    """
)


def _two_ranks(tmp_path: Path, sizes: tuple[int, int]) -> list[list[dict[str, Any]]]:
    """Each rank in its own process, agreeing through a real TCPStore."""
    store = TCPStore("127.0.0.1", 0, 3, True, timedelta(seconds=30), wait_for_workers=False)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(tmp_path / "ck"), str(store.port), str(r), str(n)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r, n in enumerate(sizes)
    ]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    return [[json.loads(line) for line in o.strip().splitlines()[-2:]] for o in outs]


def test_a_mismatch_on_one_rank_raises_on_every_rank(
    memory: SnapshotMemory, tmp_path: Path
) -> None:
    for r in (0, 1):
        seg = RamSegment.open(memory.folder / rl.segment_name(r))
        try:
            seg.write(plan({"w": torch.full((10,), float(r))}), 6, rank=r, world_size=2)
        finally:
            seg.close()
    (first0, then0), (first1, then1) = _two_ranks(tmp_path, (10, 11))
    assert "['w']" in first1["error"] and "(11,)" in first1["error"]
    assert first1["w"] == [0.0] * 11  # nothing copied on the rank that does not fit
    assert "rank(s) [1]" in first0["error"]
    # With fitting tensors both ranks restore in place (the next call of the same job).
    assert then0 == {"step": 6, "same": True, "w": [0.0] * 10}
    assert then1 == {"step": 6, "same": True, "w": [1.0] * 10}


class _Point(NamedTuple):
    x: torch.Tensor
    y: int


_A, _B = torch.zeros(2), torch.zeros(3)


@pytest.mark.parametrize(
    ("loaded", "into", "paths"),
    [
        ({"a": torch.ones(2)}, {"a": _A}, ["['a']"]),
        ({"a": torch.ones(2)}, {}, []),  # nothing to fill: stays as loaded
        ({"a": torch.ones(2)}, {"a": 5}, []),  # not a tensor there
        ({"a": torch.ones(2)}, {"a": _A, "extra": _B}, ["['a']"]),  # extra keys ignored
        ({"s": {0: {"m": torch.ones(3)}}}, {"s": {0: {"m": _B}}}, ["['s'][0]['m']"]),
        ([torch.ones(2), torch.ones(3)], (_A, _B), ["[0]", "[1]"]),
        ((torch.ones(2), 1), [_A], ["[0]"]),
        (OrderedDict(a=torch.ones(2)), {"a": _A}, ["['a']"]),
        (_Point(torch.ones(2), 1), _Point(_A, 2), []),  # other classes are not walked
        (torch.ones(2), _A, ["the state itself"]),
    ],
)
def test_bind(loaded: Any, into: Any, paths: list[str]) -> None:
    result, pairs = bind(loaded, into)
    assert [p.path for p in pairs] == paths
    for p in pairs:
        assert p.into.shape == p.loaded.shape
    if paths == ["['a']"]:
        assert result["a"] is _A
    if isinstance(loaded, tuple) and paths:
        assert isinstance(result, tuple) and result[0] is _A and result[1] == 1


@pytest.mark.parametrize(
    ("loaded", "into", "named"),
    [
        (
            {"w": torch.ones(2, 3)},
            {"w": torch.zeros(3, 2)},
            "cannot restore ['w'] in place: the checkpoint holds float32 (2, 3), the tensor given is float32 (3, 2)",
        ),
        ({"w": torch.ones(2)}, {"w": torch.zeros(2, dtype=torch.bfloat16)}, "bfloat16 (2,)"),
        ({"s": [torch.ones(1)]}, {"s": [torch.zeros(2)]}, "['s'][0]"),
    ],
)
def test_bind_refuses(loaded: Any, into: Any, named: str) -> None:
    with pytest.raises(StateMismatchError) as err:
        bind(loaded, into)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_key_path() -> None:
    assert key_path(("model", "0.weight")) == "['model']['0.weight']"
    assert key_path(("state", 3, "exp_avg")) == "['state'][3]['exp_avg']"
