"""stalwart's DCP storage writer/reader and loader in one process (DCP without a process
group): commit, checksums, rotation, and every way a folder can be bad or full."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_helpers import remount_read_only
from torch.distributed.checkpoint.api import CheckpointException

from stalwart.checkpoint import dcp as sdcp
from stalwart.checkpoint.dcp_metadata import read_metadata
from stalwart.checkpoint.dcp_records import (
    COMMIT_NAME,
    MAX_METADATA_BYTES,
    MAX_RECORD_BYTES,
    next_candidate,
    share_of,
    steps_to_delete,
)
from stalwart.checkpoint.dcp_storage import (
    DcpReader,
    DcpWriteError,
    DcpWriter,
    latest_while_resaving,
)
from stalwart.checkpoint.errors import CheckpointCorruptError

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def state(seed: int, n: int = 4096) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": {"x": torch.randn(7, generator=g)}, "n": seed}


def blank(n: int = 4096) -> dict[str, Any]:
    return {"w": torch.zeros(n), "b": {"x": torch.zeros(7)}, "n": -1}


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:09d}"


def loads_as(root: Path, seed: int | None, n: int = 4096) -> None:
    target = blank(n)
    got = sdcp.load_newest(target, root)
    if seed is None:
        assert got is None
        return
    assert got == seed
    expected = state(seed, n)
    assert torch.equal(target["w"], expected["w"]) and target["n"] == seed


def test_commit_rotation_and_latest(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        sdcp.save(state(step), tmp_path, step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_000000002",
        "step_000000003",
    ]
    assert os.readlink(tmp_path / "latest") == "step_000000003"
    files = sorted(p.name for p in step_dir(tmp_path, 3).iterdir())
    assert files == [".metadata", "__0_.stalwart.json", "__0_0.distcp", COMMIT_NAME]
    loads_as(tmp_path, 3)
    # The writer's checksums are those of the bytes on disk (hashed while written).
    sdcp.verify_share(step_dir(tmp_path, 3), 0, 1)


def test_plain_dcp_reads_ours_and_ours_reads_plain(tmp_path: Path) -> None:
    sdcp.save(state(1), tmp_path, 1)
    target = blank()
    dcp.load(target, checkpoint_id=step_dir(tmp_path, 1))  # never imports stalwart's reader
    assert torch.equal(target["w"], state(1)["w"])
    dcp.save(state(4), checkpoint_id=step_dir(tmp_path, 4))
    assert sdcp.scan(tmp_path) == sdcp.StepScan(committed=[1], plain=[4])
    loads_as(tmp_path, 4)


def test_a_torn_shard_falls_back(tmp_path: Path) -> None:
    sdcp.save(state(1), tmp_path, 1)
    sdcp.save(state(2), tmp_path, 2)
    shard = step_dir(tmp_path, 2) / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 1
    shard.write_bytes(bytes(raw))
    loads_as(tmp_path, 1)
    # The reader alone (plain dcp.load with stalwart's reader) refuses it too.
    with pytest.raises(BaseException, match="the commit record says"):
        dcp.load(blank(), storage_reader=DcpReader(step_dir(tmp_path, 2)))


def test_a_save_that_died_before_its_commit_is_not_loaded(tmp_path: Path) -> None:
    sdcp.save(state(1), tmp_path, 1)
    sdcp.save(state(2), tmp_path, 2)
    (step_dir(tmp_path, 2) / COMMIT_NAME).unlink()  # as if killed between metadata and commit
    assert sdcp.scan(tmp_path).committed == [1]
    loads_as(tmp_path, 1)


def _evil_pickle(marker: Path) -> bytes:
    class Evil:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    return pickle.dumps(Evil())


@pytest.mark.parametrize("committed", [False, True])
def test_hostile_metadata_is_never_unpickled(tmp_path: Path, committed: bool) -> None:
    root = tmp_path / "ckpt"
    sdcp.save(state(1), root, 1)
    sdcp.save(state(2), root, 2)
    marker = tmp_path / "pwned"
    folder = step_dir(root, 2)
    evil = _evil_pickle(marker)
    (folder / ".metadata").write_bytes(evil)
    if committed:
        # A stranger who can write the folder can also rewrite the commit record to
        # match: the checksum passes, the restricted unpickler still refuses.
        from stalwart.checkpoint.dcp_records import DcpCommit
        from stalwart.checkpoint.manifest import FileEntry, file_checksum

        commit = msgspec.json.decode((folder / COMMIT_NAME).read_bytes(), type=DcpCommit)
        size, digest = file_checksum(folder / ".metadata", "xxh3_64")
        files = dict(commit.files, **{".metadata": FileEntry(size, digest, "xxh3_64")})
        (folder / COMMIT_NAME).write_bytes(
            msgspec.json.encode(msgspec.structs.replace(commit, files=files))
        )
    else:
        (folder / COMMIT_NAME).unlink()
        for p in folder.glob("*.stalwart.json"):
            p.unlink()  # now a "plain DCP" folder
    loads_as(root, 1)
    with pytest.raises(CheckpointCorruptError, match="not part of DCP metadata"):
        read_metadata(folder / ".metadata")
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"garbage",
        pickle.dumps([1, 2, 3]),
        pickle.dumps({"state_dict_metadata": {}}),
    ],
)
def test_malformed_metadata_is_skipped(tmp_path: Path, payload: bytes) -> None:
    sdcp.save(state(1), tmp_path, 1)
    folder = step_dir(tmp_path, 5)
    folder.mkdir()
    (folder / ".metadata").write_bytes(payload)
    loads_as(tmp_path, 1)


def test_metadata_naming_files_outside_the_folder_is_refused(tmp_path: Path) -> None:
    dcp.save(state(3), checkpoint_id=step_dir(tmp_path, 3))
    md = read_metadata(step_dir(tmp_path, 3) / ".metadata")
    for info in md.storage_data.values():
        info.relative_path = "../../../etc/passwd"
    (step_dir(tmp_path, 3) / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointCorruptError, match="expected a file name inside the folder"):
        read_metadata(step_dir(tmp_path, 3) / ".metadata")
    loads_as(tmp_path, None)


@pytest.mark.parametrize(
    "commit",
    [
        b"{",
        b'{"format": 1}',
        b'{"format": 99, "step": 2, "world_size": 1, "files": {}, "created_unix": 0}',
        b'{"format": 1, "step": 2, "world_size": 1, "created_unix": 0,'
        b' "files": {"../x": {"size": 1, "checksum": "0", "algorithm": "xxh3_64"}}}',
        b'{"format": 1, "step": 2, "world_size": 1, "created_unix": 0,'
        b' "files": {".metadata": {"size": 1, "checksum": "0", "algorithm": "rot13"}}}',
        b'{"format": 1, "step": 2, "world_size": 1, "created_unix": 0, "files": {}}',
    ],
)
def test_hostile_commit_records_are_skipped(tmp_path: Path, commit: bytes) -> None:
    sdcp.save(state(1), tmp_path, 1)
    sdcp.save(state(2), tmp_path, 2)
    (step_dir(tmp_path, 2) / COMMIT_NAME).write_bytes(commit)
    loads_as(tmp_path, 1)


def test_oversized_records_are_not_read(tmp_path: Path) -> None:
    sdcp.save(state(1), tmp_path, 1)
    sdcp.save(state(2), tmp_path, 2)
    sdcp.save(state(3), tmp_path, 3, keep_last=None)
    # Sparse files: a size no real record or metadata has, without the disk space.
    with open(step_dir(tmp_path, 3) / COMMIT_NAME, "r+b") as f:
        f.truncate(MAX_RECORD_BYTES + 10)
    with open(step_dir(tmp_path, 2) / ".metadata", "r+b") as f:
        f.truncate(MAX_METADATA_BYTES + 10)
    (step_dir(tmp_path, 2) / COMMIT_NAME).unlink()
    for p in step_dir(tmp_path, 2).glob("*.stalwart.json"):
        p.unlink()
    with pytest.raises(CheckpointCorruptError, match="expected at most"):
        read_metadata(step_dir(tmp_path, 2) / ".metadata")
    loads_as(tmp_path, 1)


def test_disk_full_is_one_clear_error_with_the_previous_step_intact(small_tmpfs: Path) -> None:
    root = small_tmpfs / "ckpt"
    n = 64 << 10  # 256 KiB of float32
    sdcp.save(state(1, n), root, 1)
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(DcpWriteError) as info:
        sdcp.save(state(2, 1 << 20), root, 2)  # 4 MiB: does not fit in 2 MiB
    assert info.value.errno == errno.ENOSPC
    assert "step 2" in str(info.value) and "No space left on device" in str(info.value)
    assert "previous checkpoint is untouched" in str(info.value)
    assert sorted(p.name for p in root.iterdir()) == before  # nothing half-written left
    assert os.readlink(root / "latest") == "step_000000001"
    loads_as(root, 1, n)
    sdcp.save(state(3, n), root, 3)  # fits again: saving works again
    loads_as(root, 3, n)


def test_read_only_folder_is_one_clear_error(bind_mount: Path) -> None:
    sdcp.save(state(1), bind_mount, 1)
    if not remount_read_only(bind_mount):
        pytest.skip("kernel refused a read-only remount")
    with pytest.raises(DcpWriteError) as info:
        sdcp.save(state(2), bind_mount, 2)
    assert info.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    assert "step 2" in str(info.value)
    loads_as(bind_mount, 1)


def test_writer_refuses_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last=0"):
        DcpWriter(tmp_path, 1, keep_last=0)
    with pytest.raises(CheckpointCorruptError, match="rot13"):
        DcpWriter(tmp_path, 1, algorithm="rot13")
    with pytest.raises(BaseException, match="expected a step folder"):
        dcp.save(
            state(1), checkpoint_id=tmp_path / "not-a-step", storage_writer=DcpWriter(tmp_path)
        )


def test_async_saver_reuses_its_buffers(tmp_path: Path) -> None:
    saver = sdcp.AsyncDcpSaver(tmp_path, keep_last=2)
    try:
        live = state(1)
        staged, done = saver.save(live, 1)
        staged.result(timeout=30)
        live["w"].add_(1.0)  # after staging: not part of step 1
        done.result(timeout=30)
        buffers = dict(saver.stager._buffers)
        saver.save(state(2), 2)[1].result(timeout=30)
        assert all(saver.stager._buffers[k] is v for k, v in buffers.items())
    finally:
        saver.close()
    target = blank()
    dcp.load(target, checkpoint_id=step_dir(tmp_path, 1))
    assert torch.equal(target["w"], state(1)["w"])
    loads_as(tmp_path, 2)


@pytest.mark.parametrize(
    ("committed", "plain", "below", "expected"),
    [
        ([], [], None, -1),
        ([3, 1], [], None, 3),
        ([3, 1], [5], None, 5),
        ([3, 1], [5], 5, 3),
        ([3, 1], [], 1, -1),
    ],
)
def test_next_candidate(
    committed: list[int], plain: list[int], below: int | None, expected: int
) -> None:
    assert next_candidate(committed, plain, below) == expected


@pytest.mark.parametrize(
    ("committed", "present", "keep", "expected"),
    [
        ([3, 2, 1], [1, 2, 3], 3, []),
        ([3, 2, 1], [1, 2, 3], 2, [1]),
        ([5, 2], [1, 2, 3, 4, 5], 1, [1, 2, 3, 4]),  # torn 3 and 4 older than 5 go too
        ([2], [1, 2, 7], 1, []),  # not over keep_last: nothing goes
        ([4, 2], [1, 2, 4, 7], 1, [1, 2]),  # a newer torn save stays (it may be in flight)
    ],
)
def test_steps_to_delete(
    committed: list[int], present: list[int], keep: int, expected: list[int]
) -> None:
    assert steps_to_delete(committed, present, keep) == expected


def test_share_of_splits_every_file_once() -> None:
    names = [f"__{i}_0.distcp" for i in range(7)]
    shares = [share_of(names, r, 3) for r in range(3)]
    assert sorted(n for s in shares for n in s) == sorted(names)
    with pytest.raises(ValueError):
        share_of(names, 3, 3)


def test_the_checkpoint_package_does_not_import_dcp() -> None:
    code = (
        "import sys; from stalwart.checkpoint import AsyncCheckpointer, load_latest; "
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')"
        " or m.startswith('stalwart.checkpoint.dcp')))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("step", "committed", "expected"),
    [
        (2, [1, 2], 1),
        (5, [1, 3, 5, 7], 3),  # never a newer step: `latest` named 5, not 7
        (1, [1], None),
        (4, [], None),
        (2, [2, 3], None),
    ],
)
def test_latest_while_resaving(step: int, committed: list[int], expected: int | None) -> None:
    assert latest_while_resaving(step, committed) == expected


class _DiesAfterClearing(DcpWriter):
    def write_data(self, plan: Any, planner: Any) -> Any:
        raise OSError(errno.EIO, "the rank died here")


def test_a_resave_of_the_latest_step_that_dies_leaves_latest_on_a_committed_step(
    tmp_path: Path,
) -> None:
    for step in (1, 2):
        sdcp.save(state(step), tmp_path, step)
    assert os.readlink(tmp_path / "latest") == "step_000000002"
    with pytest.raises(CheckpointException, match="the rank died here"):
        dcp.save(state(9), storage_writer=_DiesAfterClearing(tmp_path, 2))
    # The re-save emptied step 2 before dying: `latest` must not name it.
    assert not (step_dir(tmp_path, 2) / COMMIT_NAME).exists()
    assert os.readlink(tmp_path / "latest") == "step_000000001"
    loads_as(tmp_path, 1)
