"""How a writer child starts (``checkpoint/seed.py``): the pure choice as a table, the
``__main__`` detection, and hostile input on the child's side of the socket."""

from __future__ import annotations

import functools
import json
import os
import socket
import struct
import sys
import types
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from stalwart.checkpoint import seed
from stalwart.checkpoint.messages import ResponseKind
from stalwart.checkpoint.seed import StartMethod, Surroundings, choose_start, pickle_args
from stalwart.checkpoint.writer import TorchFileWriter

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("needs_main", "seed_ready", "expected"),
    [
        (False, True, StartMethod.PREFORKED),
        (False, False, StartMethod.FRESH),
        (True, True, StartMethod.SPAWN),
        (True, False, StartMethod.SPAWN),
    ],
)
def test_choose_start(needs_main: bool, seed_ready: bool, expected: StartMethod) -> None:
    assert choose_start(needs_main=needs_main, seed_ready=seed_ready) is expected


def init_from_script() -> None:
    """Stands for a user's init function; moved into a main module by the test."""


@pytest.mark.parametrize("main_name", ["__main__", "__mp_main__"])
def test_arguments_that_refer_to_main_are_noticed(
    main_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    main = types.ModuleType(main_name)
    monkeypatch.setitem(sys.modules, main_name, main)
    monkeypatch.setattr(init_from_script, "__module__", main_name)
    main.init_from_script = init_from_script  # type: ignore[attr-defined]
    for args in [
        (init_from_script,),
        (None, (functools.partial(init_from_script),)),
        ({"k": [init_from_script]},),
    ]:
        _payload, needs_main = pickle_args(args)
        assert needs_main, args


def test_stalwarts_own_arguments_do_not_need_main() -> None:
    payload, needs_main = pickle_args((None, (), TorchFileWriter, {"root": "/x", "rank": 0}, 30, 5))
    assert not needs_main and payload


def _child_side(messages: list[bytes], fds: list[int]) -> dict[str, object]:
    """Runs serve_fd in a forked child fed *messages*; returns its first answer."""
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        mine.close()
        try:
            seed.serve_fd(theirs.detach())
        finally:
            os._exit(0)
    theirs.close()
    socket.send_fds(mine, [b"F"], fds)
    conn = Connection(mine.detach())
    for m in messages:
        conn.send_bytes(m)
    try:
        resp = conn.recv()
        out = {"kind": resp.kind, "message": resp.error_message}
    except EOFError:
        out = {"kind": None, "message": ""}
    conn.close()
    os.waitpid(pid, 0)
    return out


@pytest.mark.parametrize(
    "surroundings",
    [
        b"not json",
        b"[]",
        json.dumps({"sys_path": "x", "cwd": "/", "env": {}}).encode(),
        json.dumps({"sys_path": [], "cwd": 3, "env": {}}).encode(),
        json.dumps({"sys_path": [], "cwd": "/", "env": {"A": 1}}).encode(),
        b"\xff\xfe" * 10,
    ],
)
def test_hostile_surroundings_fail_the_start_with_one_line(surroundings: bytes) -> None:
    r, w = os.pipe()
    try:
        got = _child_side([surroundings, b""], [r])
    finally:
        os.close(r)
        os.close(w)
    assert got["kind"] is ResponseKind.FAILED, got
    assert "\n" not in str(got["message"]) and str(got["message"]), got


def test_oversized_surroundings_are_refused_before_they_are_read() -> None:
    # Only the length header of a 17 MiB record: the child must refuse it unread.
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        mine.close()
        try:
            seed.serve_fd(theirs.detach())
        finally:
            os._exit(0)
    theirs.close()
    r, w = os.pipe()
    socket.send_fds(mine, [b"F"], [r])
    os.close(r)
    os.close(w)
    mine.sendall(struct.pack("!i", 17 << 20))
    conn = Connection(mine.detach())
    resp = conn.recv()
    conn.close()
    os.waitpid(pid, 0)
    assert resp.kind is ResponseKind.FAILED and "length" in resp.error_message, resp


def test_surroundings_round_trip() -> None:
    s = Surroundings(["/a", "/b"], "/tmp", {"X": "1"})
    assert Surroundings.decode(s.encode()) == s


def test_a_seed_whose_parent_never_needs_it_exits_at_eof() -> None:
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        mine.close()
        try:
            seed.serve_fd(theirs.detach())
        finally:
            os._exit(7)
    theirs.close()
    mine.close()
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 7


def test_a_seed_descriptor_the_program_reused_is_never_touched(tmp_path: Path) -> None:
    # The program closed the seed's socket and a file of its own got the number: the
    # writer starts fresh, and the file is neither written to nor closed.
    from stalwart.checkpoint import CheckpointProcess

    pid = seed.prefork(fd_floor=1000)
    assert pid is not None and seed.seed_waiting()
    fd = seed._seed.sock.fileno()  # type: ignore[union-attr]
    os.close(fd)
    own = os.open(tmp_path / "mine", os.O_CREAT | os.O_RDWR)
    os.dup2(own, fd)
    os.close(own)
    try:
        kwargs = {"root": str(tmp_path / "ck"), "rank": 0, "world_size": 1}
        kwargs.update(keep_last=2, algorithm="sha256")
        cp = CheckpointProcess(TorchFileWriter, kwargs)
        try:
            cp.wait_ready(60)
            assert cp.start_method is StartMethod.FRESH
        finally:
            cp.close()
        os.write(fd, b"still mine")
        assert (tmp_path / "mine").read_bytes() == b"still mine"
    finally:
        os.close(fd)
        os.waitpid(pid, 0)  # the seed saw its socket close (EOF) and left
