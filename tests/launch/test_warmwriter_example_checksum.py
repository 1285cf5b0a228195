"""The example checks its weights in linear time (issue 21 item 7): its checksum used to
build ``bytes(untyped_storage())``, which walks the storage one element at a time in
Python (minutes for ``--width 3072``).  Counted with a profiler, not timed."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from types import FrameType, ModuleType
from typing import Any

import pytest
import torch

from tests.helpers import ROOT

pytestmark = pytest.mark.timeout(120)


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "train_ddp_example", ROOT / "examples" / "train_ddp.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _python_calls(fn: Any, *args: Any) -> tuple[Any, int]:
    count = 0

    def prof(_frame: FrameType, event: str, _arg: Any) -> None:
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(prof)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
    return result, count


def test_the_checksum_does_not_walk_tensors_element_by_element() -> None:
    ex = _example()
    model = ex.make_model(256, 0)  # 140 k parameters
    digest, calls = _python_calls(ex.checksum, model)
    elements = sum(t.numel() for t in model.state_dict().values())
    # A handful of Python calls per tensor, never one per element.
    assert calls < 50 * len(model.state_dict()) < elements, (calls, elements)
    # The same digest as hashing each tensor's raw bytes.
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    assert digest == h.hexdigest()


def test_the_checksum_reads_views_and_odd_dtypes_whole() -> None:
    ex = _example()
    strided = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()[1:]
    assert ex.tensor_bytes(strided) == strided.contiguous().numpy().tobytes()
    half = torch.arange(5, dtype=torch.bfloat16)
    assert ex.tensor_bytes(half) == half.view(torch.int16).numpy().tobytes()
    assert ex.tensor_bytes(torch.tensor(3.5)) == torch.tensor(3.5).numpy().tobytes()
    assert ex.tensor_bytes(torch.empty(0)) == b""
