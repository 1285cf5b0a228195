"""torch elastic's error-file API over stalwart's error files (issue 26 item 4, seed 001):
what torch's own ``@record`` wrote is read back; hostile files fail with one clear error
and are never followed, blocked on or read whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import clean_env

# Never imports stalwart: torch's own decorator writes the file a stalwart reader gets.
TORCH_WORKER = """
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    raise KeyError("from a torch-only worker")

main()
"""


@pytest.mark.timeout(60)
def test_error_file_of_a_torch_only_worker_is_the_root_cause(tmp_path: Path) -> None:
    from stalwart.compat.torch_elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
        record,
    )

    child_file = tmp_path / "child" / "error.json"
    child_file.parent.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", TORCH_WORKER],
        env=clean_env(TORCHELASTIC_ERROR_FILE=str(child_file)),
        capture_output=True,
        timeout=50,
    )
    assert proc.returncode == 1
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=str(child_file))
    assert "from a torch-only worker" in failure.message
    assert failure.signal_name() == "<N/A>"
    ours = tmp_path / "ours.json"

    @record
    def launcher() -> None:
        raise ChildFailedError("trainer", {3: failure})

    os.environ["TORCHELASTIC_ERROR_FILE"] = str(ours)
    try:
        with pytest.raises(ChildFailedError, match="trainer FAILED"):
            launcher()
    finally:
        del os.environ["TORCHELASTIC_ERROR_FILE"]
    copied = json.loads(ours.read_text())
    assert copied["message"]["errorCode"] == 1
    assert copied["message"]["message"] == json.loads(child_file.read_text())["message"]["message"]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"unknown_key": 1}', "with a 'message'"),
        ('{"message": 12, "timestamp": 1}', "string or an object"),
        ('{"message": "m", "timestamp": "soon"}', "is not an integer"),
        ('{"message": "m", "timestamp": true}', "integer timestamp"),
        ('{"message": {"message": "m"}}', "integer timestamp"),
        ("[" * 100_000, "nested too deeply|not JSON"),
        ("\xff\xfe not json", "not JSON"),
    ],
)
def test_hostile_error_file_one_clear_error(tmp_path: Path, content: str, expected: str) -> None:
    from stalwart.launch.workers.torch_errors import BadErrorFile, ProcessFailure

    path = tmp_path / "error.json"
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(BadErrorFile, match=expected) as info:
        ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_planted_link_fifo_and_oversized_file_are_not_read(tmp_path: Path) -> None:
    from stalwart.launch.workers import errors
    from stalwart.launch.workers.torch_errors import BadErrorFile, ErrorHandler, ProcessFailure

    secret = tmp_path / "secret.json"
    secret.write_text('{"message": "someone else\'s", "timestamp": 1}')
    link = tmp_path / "link.json"
    link.symlink_to(secret)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # nobody writes: a blocking read would hang here
    big = tmp_path / "big.json"
    with big.open("wb") as fh:
        fh.truncate(errors.MAX_ERROR_FILE + 1)
    for path, why in ((link, "cannot open"), (fifo, "not a regular file"), (big, "over")):
        with pytest.raises(BadErrorFile, match=why):
            ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    # dump_error_file refuses the same way and leaves no file of ours behind.
    ours = tmp_path / "ours.json"
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(ours)
    try:
        with pytest.raises(BadErrorFile):
            ErrorHandler().dump_error_file(str(link), 1)
    finally:
        del os.environ["TORCHELASTIC_ERROR_FILE"]
    assert not ours.exists()
    # A missing file is no error: torch's "no reply file" record.
    gone = ProcessFailure(local_rank=0, pid=7, exitcode=-9, error_file=str(tmp_path / "no"))
    assert gone.error_file == "<N/A>" and gone.message == "Signal 9 (SIGKILL) received by PID 7"
