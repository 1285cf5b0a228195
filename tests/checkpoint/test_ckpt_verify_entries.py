"""One check of files against the size and checksum a record gives them, for both records
that carry them (a rank's manifest, a DCP step's commit record): a table over damage, with
real files and no processes."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from stalwart.checkpoint.dcp_storage import verify_entries as verify_commit
from stalwart.checkpoint.errors import CheckpointCorruptError
from stalwart.checkpoint.manifest import (
    DEFAULT_ALGORITHM,
    FileEntry,
    file_checksum,
    file_identity,
    verify_entries,
)

DATA = b"weights" * 1000


def _entry(path: Path, algorithm: str = DEFAULT_ALGORITHM) -> FileEntry:
    size, digest = file_checksum(path, algorithm)
    return FileEntry(size, digest, algorithm)


def _missing(p: Path) -> None:
    p.unlink()


def _shorter(p: Path) -> None:
    p.write_bytes(DATA[:-1])


def _flipped(p: Path) -> None:
    p.write_bytes(bytes([DATA[0] ^ 1]) + DATA[1:])


def _a_folder(p: Path) -> None:
    p.unlink()
    p.mkdir()


def _a_loop(p: Path) -> None:
    p.unlink()
    p.symlink_to(p)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_missing, "is missing"),
        (_shorter, f"{len(DATA) - 1} bytes, RECORD says {len(DATA)}"),
        (_flipped, f"{DEFAULT_ALGORITHM} "),
        (_a_folder, "bytes, RECORD says"),  # a folder's size is never the file's
        (_a_loop, "cannot read"),
    ],
)
@pytest.mark.parametrize(
    ("check", "record"),
    [
        (lambda folder, files: verify_entries(folder, files, "the manifest"), "the manifest"),
        (verify_commit, "the commit record"),
    ],
)
def test_damage_is_corruption_named_with_its_record(
    tmp_path: Path,
    damage: Callable[[Path], None],
    message: str,
    check: Callable[[Path, dict[str, FileEntry]], object],
    record: str,
) -> None:
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(DATA)
    files = {path.name: _entry(path)}
    check(tmp_path, files)  # whole: no error
    damage(path)
    with pytest.raises(CheckpointCorruptError) as info:
        check(tmp_path, files)
    text = str(info.value)
    assert message.replace("RECORD", record) in text and "\n" not in text
    if damage is _flipped:
        assert f"{record} says {files[path.name].checksum}" in text


def test_identities_are_of_the_files_read() -> None:
    folder = Path(__file__).parent
    names = [Path(__file__).name, "conftest.py"]
    files = {n: _entry(folder / n) for n in names}
    got = verify_entries(folder, files, "the manifest")
    assert got == {n: file_identity(os.stat(folder / n)) for n in names}


@pytest.mark.parametrize(
    "entry",
    [
        FileEntry(len(DATA), "0" * 16, "md5; rm -rf /"),  # an algorithm no writer of ours uses
        FileEntry(len(DATA), "x" * 100_000, DEFAULT_ALGORITHM),  # an oversized checksum
        FileEntry(-1, "", DEFAULT_ALGORITHM),
        FileEntry(1 << 62, "", DEFAULT_ALGORITHM),
    ],
)
def test_hostile_entries_are_corruption_not_a_crash(tmp_path: Path, entry: FileEntry) -> None:
    (tmp_path / "f").write_bytes(DATA)
    with pytest.raises(CheckpointCorruptError):
        verify_entries(tmp_path, {"f": entry}, "the manifest")
