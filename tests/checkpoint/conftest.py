"""Fixtures for the checkpoint tests: mounts that need root, log capture helpers, the
launcher's snapshot memory."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.checkpoint import ramlayout as rl
from stalwart.launch.replicas.snapshots import SnapshotMemory


def _mount(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, so that a save can run out of space for real."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = _mount(["-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)])
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        _umount(mnt)


@pytest.fixture
def bind_mount(tmp_path: Path) -> Iterator[Path]:
    """A bind mount of a fresh folder that a test can flip to read-only."""
    src = tmp_path / "rw"
    src.mkdir()
    res = _mount(["--bind", str(src), str(src)])
    if res.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root/CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        yield src
    finally:
        _umount(src)


@pytest.fixture
def memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SnapshotMemory]:
    """The launcher's snapshot memory (2 local ranks, 8 MiB each), as this worker (local
    rank 0) finds it under ``stalwart run --ckpt-ram``."""
    base = tmp_path / "shm"
    base.mkdir()
    mem = SnapshotMemory(2, 8 << 20, base=base)
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(mem.folder))
    monkeypatch.setenv("LOCAL_RANK", "0")
    yield mem
    mem.close()
