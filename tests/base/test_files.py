"""Trusting a file found at our path, judged from its status alone (a table)."""

from __future__ import annotations

import os
import stat

import pytest

from stalwart.base.files import Kind, untrusted

ME = 1000


def _st(mode: int, uid: int = ME) -> os.stat_result:
    return os.stat_result((mode, 1, 1, 1, uid, uid, 0, 0, 0, 0))


CASES: list[tuple[str, int, int, Kind, bool, str | None]] = [
    ("our private folder", stat.S_IFDIR | 0o700, ME, "folder", True, None),
    ("our private file", stat.S_IFREG | 0o600, ME, "file", True, None),
    ("our fifo", stat.S_IFIFO | 0o600, ME, "fifo", False, None),
    ("readable by others, not asked private", stat.S_IFDIR | 0o755, ME, "folder", False, None),
    (
        "readable by group, asked private",
        stat.S_IFREG | 0o640,
        ME,
        "file",
        True,
        "no group/other access, found mode -rw-r-----",
    ),
    ("another user's", stat.S_IFDIR | 0o700, 0, "folder", False, "owned by uid 1000, found uid 0"),
    (
        "a link where a folder should be",
        stat.S_IFLNK | 0o777,
        ME,
        "folder",
        False,
        "expected a folder, found a symbolic link",
    ),
    (
        "a file where a fifo should be",
        stat.S_IFREG | 0o600,
        ME,
        "fifo",
        False,
        "expected a fifo, found a file",
    ),
    (
        "a socket where a file should be",
        stat.S_IFSOCK | 0o600,
        ME,
        "file",
        True,
        "found another kind of file",
    ),
    # The kind is judged first: a planted link says what it is, whoever owns it.
    ("another user's link", stat.S_IFLNK | 0o777, 0, "file", True, "found a symbolic link"),
]


@pytest.mark.parametrize(
    ("mode", "uid", "kind", "private", "expected"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_untrusted(mode: int, uid: int, kind: Kind, private: bool, expected: str | None) -> None:
    problem = untrusted(_st(mode, uid), kind, private=private, uid=ME)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and expected in problem


def test_defaults_to_this_process_uid(tmp_path: os.PathLike[str]) -> None:
    assert untrusted(os.lstat(tmp_path), "folder", private=False) is None
