"""Round trips through AsyncCheckpointer and load_latest, and the on-disk format."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from ckpt_helpers import Custom, make_state

from stalwart.checkpoint import (
    AsyncCheckpointer,
    CheckpointerConfig,
    StagingMode,
    load_latest,
)


def _training_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
    return model, opt


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.timeout(60)
def test_round_trip_model_optimizer_and_python_objects(tmp_path: Path) -> None:
    model, opt = _training_state()
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "python": {"epoch": 3, "name": "run-1", "lr": [0.1, 0.01], "pair": (1, "a"), "none": None},
        "odd_tensors": {
            "bf16": torch.randn(5).to(torch.bfloat16),
            "bool": torch.tensor([True, False, True]),
            "int64_scalar": torch.tensor(7),
            "empty": torch.empty(0, 3),
            "transposed": base.t(),  # non-contiguous: saved contiguous, same values
            "slice": base[1:3, ::2],
        },
    }
    state["odd_tensors"]["alias"] = state["odd_tensors"]["bf16"]
    with AsyncCheckpointer(tmp_path, keep_last=3, rank=0, world_size=1) as ckpt:
        result = ckpt.save(state, step=5).result(timeout=30)
    assert result.step == 5 and result.step_complete
    found = load_latest(tmp_path, rank=0)
    assert found is not None
    assert found.step == 5
    assert found.path == tmp_path / "step_000000005" / "rank_0.pt"
    _assert_same(state, found.state_dict)
    # The same object saved twice stays one tensor after loading.
    assert found.state_dict["odd_tensors"]["alias"] is found.state_dict["odd_tensors"]["bf16"]

    # The restored optimizer and model accept the state.
    model2, opt2 = _training_state()
    model2.load_state_dict(found.state_dict["model"])
    opt2.load_state_dict(found.state_dict["optim"])

    manifest = json.loads((tmp_path / "step_000000005" / "rank_0.manifest.json").read_text())
    entry = manifest["files"]["rank_0.pt"]
    assert manifest["step"] == 5 and manifest["world_size"] == 1
    assert entry["size"] == found.path.stat().st_size
    assert entry["algorithm"] in ("crc32", "xxh3_64") and entry["checksum"]
    assert (tmp_path / "latest").readlink() == Path("step_000000005")


@pytest.mark.timeout(60)
def test_plain_torch_load_reads_it_without_stalwart(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, keep_last=1, rank=0, world_size=1) as ckpt:
        ckpt.save({"w": torch.arange(10.0), "meta": {"k": [1, 2]}}, step=1).result(timeout=30)
    code = (
        "import sys, torch; "
        "sd = torch.load(sys.argv[1], weights_only=True); "
        "assert torch.equal(sd['w'], torch.arange(10.0)) and sd['meta'] == {'k': [1, 2]}; "
        "assert 'stalwart' not in sys.modules; print('ok')"
    )
    # -I: isolated, so the editable stalwart install is not even on the path.
    out = subprocess.run(
        [sys.executable, "-I", "-c", code, str(tmp_path / "latest" / "rank_0.pt")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.timeout(60)
def test_custom_objects_need_weights_only_false(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, keep_last=2, rank=0, world_size=1) as ckpt:
        ckpt.save({"obj": Custom("x", [1, 2]), "t": torch.ones(2)}, step=1).result(timeout=30)
    # A file that verifies but holds a class weights_only refuses is an error,
    # not corruption: it must not silently fall back to an older step.
    with pytest.raises(Exception, match=r"weights_only|Unsupported global|WeightsUnpickler"):
        load_latest(tmp_path, rank=0)
    found = load_latest(tmp_path, rank=0, weights_only=False)
    assert found is not None and found.state_dict["obj"] == Custom("x", [1, 2])


@pytest.mark.timeout(60)
def test_state_dict_passed_as_future(tmp_path: Path) -> None:
    pending: Future[dict[str, torch.Tensor]] = Future()
    with AsyncCheckpointer(tmp_path, keep_last=2, rank=0, world_size=1) as ckpt:
        fut = ckpt.save(pending, step=2)
        assert not fut.done()
        # Staging finishes later, on another thread.
        threading.Thread(target=pending.set_result, args=({"w": torch.full((3,), 2.0)},)).start()
        assert fut.result(timeout=30).step == 2
        # A plain save after a Future one keeps order and does not deadlock.
        ckpt.save({"w": torch.full((3,), 3.0)}, step=3).result(timeout=30)
    found = load_latest(tmp_path, rank=0)
    assert found is not None and found.step == 3
    assert torch.equal(found.state_dict["w"], torch.full((3,), 3.0))


@pytest.mark.timeout(60)
def test_keep_last_k_and_buffer_reuse(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, keep_last=2, rank=0, world_size=1) as ckpt:
        ckpt.wait_ready(timeout=30)
        capacities = []
        for step in range(1, 6):
            ckpt.save({"w": torch.full((1000,), float(step))}, step=step)
            capacities.append(ckpt._process._buffer.capacity)
        ckpt.wait()
        # Same-sized state dicts reuse the same pre-allocated buffer.
        assert len(set(capacities)) == 1
        ckpt.save({"w": torch.zeros(1 << 20)}, step=6).result(timeout=30)
        assert ckpt._process._buffer.capacity > capacities[0]
    steps = sorted(p.name for p in tmp_path.glob("step_*"))
    assert steps == ["step_000000005", "step_000000006"]
    assert not list(tmp_path.glob(".tmp-*"))
    found = load_latest(tmp_path, rank=0)
    assert found is not None and found.step == 6


@pytest.mark.timeout(60)
def test_snapshot_is_taken_at_save_time(tmp_path: Path) -> None:
    w = torch.zeros(1 << 16)
    with AsyncCheckpointer(tmp_path, keep_last=2, rank=0, world_size=1) as ckpt:
        fut = ckpt.save({"w": w}, step=1)
        w.add_(1.0)  # training goes on right away
        fut.result(timeout=30)
    found = load_latest(tmp_path, rank=0)
    assert found is not None and float(found.state_dict["w"].sum()) == 0.0


@pytest.mark.timeout(60)
def test_background_staging_guards_optimizer_step(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.zeros(1 << 18))
    opt = torch.optim.SGD([param], lr=1.0)
    cfg = CheckpointerConfig(staging=StagingMode.BACKGROUND)
    with AsyncCheckpointer(tmp_path, keep_last=2, rank=0, world_size=1, config=cfg) as ckpt:
        fut = ckpt.save({"p": param}, step=1)
        param.grad = torch.ones_like(param)
        opt.step()  # the pre-step hook waits until the snapshot has been copied
        fut.result(timeout=30)
    found = load_latest(tmp_path, rank=0)
    assert found is not None
    assert float(found.state_dict["p"].detach().abs().sum()) == 0.0
    assert float(param.detach().sum()) == -(1 << 18)


@pytest.mark.timeout(90)
def test_two_ranks_share_a_step_folder(tmp_path: Path) -> None:
    r0 = AsyncCheckpointer(tmp_path, keep_last=2, rank=0, world_size=2)
    r1 = AsyncCheckpointer(tmp_path, keep_last=2, rank=1, world_size=2)
    try:
        f0 = r0.save({"rank": 0, "w": torch.zeros(4)}, step=1)
        f1 = r1.save({"rank": 1, "w": torch.ones(4)}, step=1)
        assert f0.result(timeout=30).step == 1 and f1.result(timeout=30).step == 1
        assert (tmp_path / "latest").readlink() == Path("step_000000001")
        # Only rank 0 gets to step 2: the step is incomplete and `latest` stays.
        res = r0.save({"rank": 0, "w": torch.zeros(4)}, step=2).result(timeout=30)
        assert not res.step_complete
        assert (tmp_path / "latest").readlink() == Path("step_000000001")
        for rank in (0, 1):
            found = load_latest(tmp_path, rank=rank)
            assert found is not None and found.step == 1
            assert found.state_dict["rank"] == rank
        r1.save({"rank": 1, "w": torch.ones(4)}, step=2).result(timeout=30)
        assert (tmp_path / "latest").readlink() == Path("step_000000002")
    finally:
        r0.close()
        r1.close()


@pytest.mark.timeout(60)
def test_reserve_for_sizes_the_buffer_ahead_of_the_first_save(tmp_path: Path) -> None:
    state = {"w": torch.randn(1 << 20), "b": torch.randn(1000)}
    with AsyncCheckpointer(tmp_path, keep_last=1, rank=0, world_size=1) as ckpt:
        ckpt.reserve_for(state).result(timeout=30)
        capacity = ckpt._process._buffer.capacity
        assert capacity >= (1 << 22)
        ckpt.save(state, step=1).result(timeout=30)
        assert ckpt._process._buffer.capacity == capacity  # no growth on the first save


@pytest.mark.timeout(60)
def test_reservation_racing_a_save_does_not_deadlock(tmp_path: Path) -> None:
    cfg = CheckpointerConfig(reserve_bytes=8 << 20)
    with AsyncCheckpointer(tmp_path, keep_last=1, rank=0, world_size=1, config=cfg) as ckpt:
        # Saved before the writer is even up: the start-up reservation must not
        # wait for the buffer this snapshot holds.
        fut = ckpt.save({"w": torch.ones(1 << 16)}, step=1)
        ckpt.reserve_for({"w": torch.ones(1 << 20)})
        ckpt.save({"w": torch.ones(1 << 16)}, step=2)
        assert fut.result(timeout=30).step == 1
        ckpt.wait(timeout=30)


@pytest.mark.timeout(60)
def test_checkpoint_package_does_not_import_the_launcher() -> None:
    code = (
        "import sys, stalwart.checkpoint; "
        "bad = [m for m in sys.modules if m.startswith('stalwart.launch')]; "
        "assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr


@pytest.mark.timeout(30)
def test_rank_and_world_size_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with AsyncCheckpointer(tmp_path, keep_last=1) as ckpt:
        assert (ckpt.rank, ckpt.world_size) == (1, 4)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="outside world_size"):
        AsyncCheckpointer(tmp_path, keep_last=1, rank=2)


@pytest.mark.timeout(60)
def test_resave_keeps_the_plain_file_name_and_takes_the_new_state(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, keep_last=1, rank=0, world_size=1) as ckpt:
        for seed in (1, 2, 3):
            res = ckpt.save(make_state(seed, mib=0.05), step=4).result(timeout=60)
            assert res.path.name == "rank_0.pt"
            # Plain torch.load through `latest`, as the docs promise, sees each re-save.
            plain = torch.load(tmp_path / "latest" / "rank_0.pt", weights_only=True)
            assert torch.equal(plain["w"], make_state(seed, mib=0.05)["w"])
    folder = tmp_path / "step_000000004"
    assert sorted(p.name for p in folder.iterdir()) == ["rank_0.manifest.json", "rank_0.pt"]
    assert not list(tmp_path.glob(".tmp-*"))
