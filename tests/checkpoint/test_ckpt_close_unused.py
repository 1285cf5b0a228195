"""Closing a checkpointer that never wrote does not wait for its writer child to finish
starting (a fresh interpreter importing torch): an in-process restart closes one made
inside the wrapped function on every fault. torch's CheckpointProcess keeps waiting."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from stalwart.checkpoint import AsyncCheckpointer, CheckpointProcess, TorchFileWriter
from stalwart.checkpoint.errors import WriterDiedError


@pytest.mark.timeout(60)
def test_an_unused_checkpointer_abandons_its_starting_writer(tmp_path: Path) -> None:
    ck = AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1)
    writer = ck._writer  # the child was started in the constructor (no RAM snapshots)
    assert writer is not None
    ck.close()
    # The start was abandoned, not completed: the child never answered its ping.
    exc = writer.process_creation_future.exception(timeout=30)
    assert isinstance(exc, WriterDiedError), exc
    # multiprocessing's resource tracker lives as long as this interpreter, as always.
    left = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert not left


@pytest.mark.timeout(120)
def test_a_checkpointer_that_wrote_closes_gracefully(tmp_path: Path) -> None:
    ck = AsyncCheckpointer(tmp_path / "ck", rank=0, world_size=1)
    writer = ck._writer
    assert writer is not None
    ck.save({"w": [1, 2, 3]}, 1)
    ck.close()
    assert writer.process_creation_future.exception(timeout=30) is None
    assert list((tmp_path / "ck").glob("step_*")), "the save was written before the close"


@pytest.mark.timeout(120)
def test_torchs_form_waits_for_its_start_even_unused(tmp_path: Path) -> None:
    kwargs = {"root": str(tmp_path), "rank": 0, "world_size": 1, "keep_last": None}
    proc = CheckpointProcess(TorchFileWriter, {**kwargs, "algorithm": "xxh3_64"})
    proc.close()
    assert proc.process_creation_future.exception(timeout=30) is None
