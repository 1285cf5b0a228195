"""torch elastic's file timer API over stalwart's pipe server (issue 26 item 4, seed 003):
a worker that only knows torch's client is reaped on expiry, and what a stranger writes
into the pipe (forged pids, garbage, oversized lines) never signals anything else."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import alive, clean_env

# Never imports stalwart: torch's own client, as a torchrun user's script has it.
TORCH_WORKER = """
import sys, time
import torch.distributed.elastic.timer as timer
timer.configure(timer.FileTimerClient(sys.argv[1]))
print("armed", flush=True)
with timer.expires(after=float(sys.argv[2]), scope="step"):
    time.sleep(60)
"""


def _line(pid: int, scope: str = "s", expiry: float | None = None, sig: int = 9) -> bytes:
    body = {
        "version": 1,
        "pid": pid,
        "scope_id": scope,
        "expiration_time": time.time() - 60 if expiry is None else expiry,
        "signal": sig,
    }
    return json.dumps(body).encode() + b"\n"


@pytest.mark.timeout(90)
def test_torch_client_worker_reaped_and_forged_requests_signal_nothing(tmp_path: Path) -> None:
    from stalwart.monitor.file_timer import FileTimerServer

    fifo = tmp_path / "timer.pipe"
    server = FileTimerServer(str(fifo), "run", max_interval=0.05)
    server.start()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker = subprocess.Popen(
        [sys.executable, "-c", TORCH_WORKER, str(fifo), "1"],
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        assert (fifo.stat().st_mode & 0o777) == 0o600
        # A stranger's lines, all already expired: a negative pid (kill(2) would signal a
        # whole process group), pid 1, the server's own pid, a pid that does not exist,
        # garbage and an oversized line; then one for the bystander with signal 0
        # (observe only). None of them may signal anything.
        forged = b"".join(
            [
                _line(-os.getpgid(0)),
                _line(1),
                _line(os.getpid()),
                _line(2**22 + 12345),
                b"{not json\n",
                b"x" * 200_000 + b"\n",
                _line(bystander.pid, sig=0),
            ]
        )
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            view = memoryview(forged)
            while view:
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    time.sleep(0.01)
        finally:
            os.close(fd)
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "armed"
        # The worker's own timer still expires (1 s) and reaps it, despite the flood.
        assert worker.wait(timeout=60) == -signal.SIGKILL
        server.run_once()
        assert alive(bystander.pid)
        assert server._timers == {}
        assert server._request_count >= 2  # the worker's acquire, the bystander's line
    finally:
        server.stop()
        for p in (bystander, worker):
            p.kill()
            p.wait()
    assert not fifo.exists()


def test_planted_file_refused_and_expires_bad_input(tmp_path: Path) -> None:
    from stalwart.monitor import file_timer

    planted = tmp_path / "timer.pipe"
    planted.write_text("someone else's file")
    with pytest.raises(RuntimeError, match="not our FIFO"):
        file_timer.FileTimerServer(str(planted), "run").start()
    assert planted.read_text() == "someone else's file"
    file_timer.configure(None)
    with pytest.raises(RuntimeError, match="configure"), file_timer.expires(after=1):
        pass
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="after"), file_timer.expires(after=bad):
            pass
    # No server: torch's error type, and nothing created at the path.
    client = file_timer.FileTimerClient(str(tmp_path / "absent"))
    with pytest.raises(BrokenPipeError), file_timer.expires(after=1, client=client):
        pass
    assert not (tmp_path / "absent").exists()
