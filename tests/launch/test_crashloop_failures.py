"""One failure record, read at the edge: ``read_failure`` turns a dead worker and its
error file into the ``WorkerFailed`` the nodes exchange; the file is the worker's to
write, so every shape of it is survived and nothing in it is believed blindly."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import msgspec
import pytest

from stalwart.launch import ProcessFailure
from stalwart.launch.workers.errors import MAX_ERROR_FILE, write_error_file
from stalwart.launch.workers.failures import read_failure
from stalwart.rendezvous.api import WorkerFailed, decode_failure

pytestmark = pytest.mark.timeout(30)

EXIT = 1_800_000_000.0


def read(path: Path | str, exitcode: int = 1) -> WorkerFailed:
    return read_failure(1, 42, exitcode, exited_at=EXIT, rank=3, node_rank=2, error_file=str(path))


def test_a_real_error_file_round_trips_through_the_store(tmp_path: Path) -> None:
    try:
        raise ValueError("config key 'lr' missing")
    except ValueError as exc:
        path = write_error_file(exc, str(tmp_path / "error.json"))
    assert path is not None
    f = read(path)
    assert f.message == "ValueError: config key 'lr' missing"
    assert "Traceback" in f.traceback and f.timestamp < EXIT
    assert (f.rank, f.node_rank, f.local_rank, f.pid, f.signal) == (3, 2, 1, 42, None)
    # The record the launcher keeps is the record the store carries.
    assert decode_failure(f.encode()) == f
    assert ProcessFailure is WorkerFailed


def test_no_file_is_the_exit_itself(tmp_path: Path) -> None:
    f = read(tmp_path / "absent.json", exitcode=-9)
    assert (f.message, f.traceback, f.timestamp, f.signal) == ("", "", EXIT, "SIGKILL")
    assert read("").timestamp == EXIT


def _file(tmp_path: Path, content: bytes | str) -> Path:
    p = tmp_path / "error.json"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return p


def _torch(message: object = "E: x", **extra: object) -> str:
    return json.dumps({"message": {"message": message, "extraInfo": extra}})


@pytest.mark.parametrize(
    ("content", "message", "timestamp"),
    [
        # torch's own format: whole seconds only.
        (_torch(timestamp="1700000000"), "E: x", 1_700_000_000.0),
        (_torch(timestamp_ns="1700000000500000000"), "E: x", 1_700_000_000.5),
        # A time after the exit is not believed (a stepped clock, a forged file).
        (_torch(timestamp="2000000000"), "E: x", EXIT),
        # Wrong types and garbage: the message survives, the time is the exit's.
        (_torch(timestamp="soon"), "E: x", EXIT),
        (_torch(timestamp=True), "E: x", EXIT),
        (_torch(timestamp=1.5), "E: x", EXIT),
        (_torch(timestamp="9" * 5000), "E: x", EXIT),
        (_torch(timestamp_ns=10**400), "E: x", EXIT),
        (json.dumps({"message": {"message": "E: x", "extraInfo": "nope"}}), "E: x", EXIT),
        (json.dumps({"message": "plain text"}), "plain text", EXIT),
        (json.dumps({"message": ["a", "list"]}), "", EXIT),
        (json.dumps(["not", "a", "dict"]), "", EXIT),
        ("not json at all", "", EXIT),
        ("[" * 100_000, "", EXIT),
        (b"\xff\xfe\x00garbage", "", EXIT),
        ("", "", EXIT),
    ],
)
def test_hostile_error_files(tmp_path: Path, content: str, message: str, timestamp: float) -> None:
    f = read(_file(tmp_path, content))
    assert f.message == message
    assert f.timestamp == pytest.approx(timestamp)
    msgspec.json.encode(f)  # whatever was read, the record still crosses the store


def test_an_oversized_file_is_not_read(tmp_path: Path) -> None:
    big = _torch("E: " + "x" * MAX_ERROR_FILE)
    f = read(_file(tmp_path, big))
    assert f.message == "" and f.timestamp == EXIT


def test_a_pipe_planted_at_the_path_does_not_block(tmp_path: Path) -> None:
    p = tmp_path / "error.json"
    os.mkfifo(p)
    done = threading.Event()
    result: list[WorkerFailed] = []

    def go() -> None:
        result.append(read(p))
        done.set()

    threading.Thread(target=go, daemon=True).start()
    assert done.wait(10), "read_failure blocked on a FIFO"
    assert result[0].message == ""


def test_a_link_planted_at_the_path_is_not_followed(tmp_path: Path) -> None:
    target = _file(tmp_path, _torch("E: someone else's"))
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert read(link).message == ""
