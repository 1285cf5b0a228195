"""A worker whose program crashed (an uncaught exception) exits as soon as what the
program can see of a shutdown is done, so the launcher restarts the job without waiting
for the interpreter's teardown (1-3 s for a rank with a large heap on a loaded machine,
issue 24 item 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import clean_env, events, stalwart

HERE = Path(__file__).parent
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_a_crashed_worker_exits_without_the_interpreter_teardown(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = stalwart(
        "--nproc-per-node", "1", "--max-restarts", "0", "--log-dir", tmp_path / "logs",
        *(["--no-warm"] if mode == "cold" else []), HERE / "crasher.py", out,
        env=clean_env(), timeout=100,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    # What a shutdown does that the program can see still happens, in order: the
    # non-daemon thread finished, the atexit handler ran, the open file was flushed.
    assert (out / "thread_done").exists()
    assert (out / "atexit_ran").exists()
    assert (out / "unflushed.txt").read_text() == "written before the crash\n"
    # The traceback is printed and reported as under torchrun.
    assert "RuntimeError: crashing on purpose" in proc.stderr
    exits = [e for e in events(tmp_path / "logs") if e["event"] == "worker_exit"]
    assert [e["exitcode"] for e in exits] == [1]
    error = json.loads(next((tmp_path / "logs").glob("*/attempt_0/0/error.json")).read_text())
    assert "crashing on purpose" in json.dumps(error)
    # The leftover object's 30 s __del__ (the interpreter's teardown) never ran: the
    # worker was gone well before it could have finished.
    fault = float((out / "fault").read_text())
    assert float(exits[0]["exited_at"]) - fault < 15
