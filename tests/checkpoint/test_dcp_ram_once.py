"""A shard set in the launcher's memory is hashed once per process and commit record
(issue 23): the process keeps one read-only mapping per segment file
(``ramshared``), so a second restore neither hashes nor maps nor unmaps again, and the
pre-check a warm worker starts at its start is what the restore then relies on. A slot
rewritten through the protocol (a new record), a segment file replaced at its path, or
bytes changed before this process verified them are hashed again and refused when they
differ; a stranger can reach none of it.

Real segments and real DCP loads in this process; hashing is counted by wrapping the
segment's own hash routine."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from stalwart.checkpoint import dcp as sdcp
from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint import ramshared
from stalwart.checkpoint.dcp_ram import find_all_shards, load_from_ram
from stalwart.checkpoint.ram import RamSegment

pytestmark = pytest.mark.timeout(60)


def _segment(folder: Path, local: int = 0) -> Path:
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / rl.segment_name(local)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, rl.segment_bytes(2 << 20))
    os.close(fd)
    return path


def _state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1 << 15, dtype=torch.float32) + v, "b": torch.full((3,), v)}


def _save(path: Path, root: Path, step: int, v: float) -> None:
    seg = RamSegment.open(path)
    try:
        sdcp.save(_state(v), root, step, ram=seg, keep_last=None)  # type: ignore[arg-type]
    finally:
        seg.close()


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(thread name, step) of every slot hash."""
    seen: list[tuple[str, int]] = []
    real = RamSegment._hash_matches

    def counted(
        self: RamSegment, slot: int, record: rl.CommitRecord, stop: threading.Event | None
    ) -> bool | None:
        seen.append((threading.current_thread().name, record.step))
        return real(self, slot, record, stop)

    monkeypatch.setattr(RamSegment, "_hash_matches", counted)
    return seen


def _load(root: Path, newest_on_disk: int, v: float) -> int | None:
    into = {"w": torch.zeros(1 << 15), "b": torch.zeros(3)}
    got = load_from_ram(into, root, newest_on_disk)
    if got is not None:
        want = _state(v)
        assert all(torch.equal(into[k], want[k]) for k in want), into
    return got


def test_a_second_restore_hashes_nothing_until_the_slot_is_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashes: list[tuple[str, int]]
) -> None:
    path = _segment(tmp_path / "ram")
    root = tmp_path / "ckpt"
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(path.parent))
    _save(path, root, 1, 1.0)
    assert _load(root, 1, 1.0) == 1
    assert _load(root, 1, 1.0) == 1
    assert [s for _, s in hashes] == [1]  # the old path hashed it on every restore
    seg = ramshared.SEGMENTS.get(path)
    assert seg is not None and ramshared.SEGMENTS.get(path) is seg  # one mapping, kept
    # A later save goes into the other slot through the protocol (record first cleared,
    # a new one written last): the new record is not the one verified, so it is hashed.
    _save(path, root, 2, 2.0)
    assert _load(root, 2, 2.0) == 2
    assert [s for _, s in hashes] == [1, 2]


def test_bytes_changed_before_this_process_verified_them_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashes: list[tuple[str, int]]
) -> None:
    """Changed through a second writable mapping after the commit (the record still
    claims the old hash): the pre-check fails, so the restore hashes again and refuses;
    there is nothing newer on disk than RAM claimed, so nothing loads from RAM."""
    path = _segment(tmp_path / "ram")
    root = tmp_path / "ckpt"
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(path.parent))
    _save(path, root, 1, 1.0)
    (held,) = find_all_shards(path.parent, str(root))
    import mmap

    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        at = rl.data_offset(held.slot, rl.slot_capacity(len(m))) + held.record.tensor_offset
        m[at + held.record.tensor_bytes // 2] ^= 0xFF
    assert ramshared.precheck(path.parent, 0) == 1
    assert _load(root, 1, 1.0) is None
    assert [(n == "stalwart-ram-verify", s) for n, s in hashes] == [(True, 1), (False, 1)]


def test_a_replaced_segment_file_is_mapped_and_hashed_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashes: list[tuple[str, int]]
) -> None:
    """A file put at the segment's path (a new inode) is not the mapping verified: its
    slot is hashed, and a copy whose bytes differ from its record is refused."""
    path = _segment(tmp_path / "ram")
    root = tmp_path / "ckpt"
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(path.parent))
    _save(path, root, 1, 1.0)
    assert _load(root, 1, 1.0) == 1
    old = ramshared.SEGMENTS.get(path)
    raw = bytearray(path.read_bytes())
    (held,) = find_all_shards(path.parent, str(root))
    at = rl.data_offset(held.slot, rl.slot_capacity(len(raw))) + held.record.tensor_offset
    raw[at + 5] ^= 0xFF
    fresh = path.with_suffix(".tmp")
    fd = os.open(fresh, os.O_CREAT | os.O_WRONLY, 0o600)
    os.write(fd, bytes(raw))
    os.close(fd)
    os.replace(fresh, path)
    assert _load(root, 1, 1.0) is None
    assert ramshared.SEGMENTS.get(path) is not old
    assert [s for _, s in hashes] == [1, 1]


def test_precheck_of_a_worker_without_ram_or_shards_does_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(rl.RAM_DIR_ENV, raising=False)
    assert ramshared.precheck_from_env() == 0
    path = _segment(tmp_path / "ram")
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(path.parent))
    monkeypatch.setenv("RANK", "0")
    assert ramshared.precheck_from_env() == 0  # an empty segment
    for bad in ("-1", "x" * 10_000, ""):
        monkeypatch.setenv("RANK", bad)
        assert ramshared.precheck_from_env() == 0
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(tmp_path / "gone"))
    assert ramshared.precheck_from_env() == 0


def test_a_segment_another_user_could_write_is_never_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = _segment(tmp_path / "ram")
    root = tmp_path / "ckpt"
    _save(path, root, 1, 1.0)
    path.chmod(0o666)
    monkeypatch.setenv(rl.RAM_DIR_ENV, str(path.parent))
    assert ramshared.SEGMENTS.get(path) is None
    assert ramshared.precheck(path.parent, 0) == 0
    assert _load(root, 1, 1.0) is None
    assert "skipping snapshot segment" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_a_stranger_cannot_open_the_segment_or_this_process_s_descriptor_of_it(
    tmp_path: Path,
) -> None:
    """Another user reaches neither the file (0600 in a 0700 folder) nor the open
    descriptor through /proc/PID/fd (the kernel asks for ptrace access there)."""
    path = _segment(tmp_path / "ram")
    tmp_path.chmod(0o755)
    fd = os.open(path, os.O_RDWR)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the stranger
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            got = []
            for target in (str(path), f"/proc/{os.getppid()}/fd/{fd}"):
                try:
                    os.close(os.open(target, os.O_RDWR))
                    got.append("opened")
                except PermissionError:
                    got.append("denied")
                except OSError as exc:
                    got.append(type(exc).__name__)
            os.write(w, ",".join(got).encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            said = f.read().decode()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert said == "denied,denied", said
    finally:
        os.close(fd)
