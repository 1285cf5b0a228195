"""torch elastic's timer API and multiprocessing-queue timers over stalwart (issue 26
item 4, seed 003): a worker that only knows torch's own client is reaped when its
timer expires; what else reaches the queue (a process that is not the server's, a
process group, the server itself, garbage, oversized or endless requests) signals
nothing and stays bounded; hostile TORCHELASTIC_SIGNALS_TO_HANDLE names do not stop
`start_processes`."""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import alive, wait_for

# Never imports stalwart: torch's own client and `expires`, as a torch user's worker
# has them; it reports what it imported before it hangs in its timed block.
TORCH_ONLY_WORKER = """
import sys, time
import torch.distributed.elastic.timer as timer

def hang_under_timer(mp_queue, marker):
    timer.configure(timer.LocalTimerClient(mp_queue))
    imported = sorted(m for m in sys.modules if m.split(".")[0] == "stalwart")
    with open(marker, "w") as fh:
        fh.write(repr(imported))
    with timer.expires(after=0.5, scope="step"):
        time.sleep(60)
"""


class _Stranger:
    """An object with a request's field names and hostile values."""

    def __init__(self, worker_id: object, scope_id: object, expiration_time: object) -> None:
        self.worker_id = worker_id
        self.scope_id = scope_id
        self.expiration_time = expiration_time


@pytest.mark.parametrize(
    ("item", "why"),
    [
        ("a string", "worker_id must be a pid"),
        (_Stranger(True, "s", 1.0), "worker_id must be a pid"),
        (_Stranger(12.5, "s", 1.0), "worker_id must be a pid"),
        (_Stranger(5, None, 1.0), "scope_id must be a str"),
        (_Stranger(5, "x" * 5000, 1.0), "5000 characters"),
        (_Stranger(5, "s", "soon"), "expiration_time must be a number"),
        (_Stranger(5, "s", True), "expiration_time must be a number"),
        (_Stranger(5, "s", math.nan), "finite"),
        (_Stranger(5, "s", math.inf), "finite"),
    ],
)
def test_malformed_requests_are_named(item: object, why: str) -> None:
    from stalwart.monitor.torch_local_timer import parse_request

    assert why in str(parse_request(item))


def test_requests_and_whom_to_signal_as_tables() -> None:
    from stalwart.compat.torch_elastic.timer.api import TimerRequest
    from stalwart.monitor.torch_local_timer import parse_request, refusal

    # Any class with the fields (torch's own, in the process test) is read; an int time
    # is a float.
    assert parse_request(_Stranger(7, "s", 3)) == TimerRequest(7, "s", 3.0)
    assert parse_request(TimerRequest(7, "s", -1)) == TimerRequest(7, "s", -1.0)
    me = 4242
    table = [
        # (pid, descends from the server, refused because)
        (-me, True, "process group"),
        (0, True, "process group"),
        (1, True, "init"),
        (me, True, "own process"),
        (5000, False, "not a process this server's process started"),
        (5000, True, None),
    ]
    for pid, descends, why in table:
        got = refusal(pid, me, descends)
        assert (got is None) if why is None else (got is not None and why in got), (pid, got)


@pytest.mark.timeout(60)
def test_torch_only_worker_reaped_and_strangers_signal_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stalwart.compat import torch_elastic  # noqa: F401  (the path a user imports)
    from stalwart.compat.torch_elastic import timer
    from stalwart.compat.torch_elastic.timer.api import TimerRequest
    from stalwart.monitor.torch_local_timer import MAX_TIMERS_PER_PID

    (tmp_path / "torch_only_worker.py").write_text(TORCH_ONLY_WORKER)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawn hands sys.path to the child
    import torch_only_worker  # type: ignore[import-not-found]

    # A process that is not the server's: its parent exits, so it is nobody's child here.
    launcher = subprocess.run(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)'], start_new_session=True, stdin=subprocess.DEVNULL, "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    stranger = int(launcher.stdout)
    ctx = mp.get_context("spawn")
    mp_queue = ctx.Queue()
    server = timer.LocalTimerServer(mp_queue, max_interval=0.05)
    marker = tmp_path / "imported"
    worker = ctx.Process(target=torch_only_worker.hang_under_timer, args=(mp_queue, marker))
    try:
        expired = time.time() - 60
        later = time.time() + 600
        forged = [
            TimerRequest(stranger, "foreign", expired),
            TimerRequest(-os.getpgid(0), "group", expired),
            TimerRequest(1, "init", expired),
            TimerRequest(os.getpid(), "server", expired),
            TimerRequest(stranger, "x" * 1_000_000, expired),
            TimerRequest(stranger, "nan", math.nan),
            "garbage",
            {"worker_id": stranger, "scope_id": "dict", "expiration_time": expired},
            12345,
        ]
        for item in forged:
            mp_queue.put(item)
        # More scopes than one worker may hold, for a live pid that is not expiring yet.
        for i in range(MAX_TIMERS_PER_PID + 500):
            mp_queue.put(TimerRequest(os.getppid(), f"leak{i}", later))
        server.start()
        worker.start()
        worker.join(timeout=40)
        assert worker.exitcode == -signal.SIGKILL
        assert marker.read_text() == "[]"  # the worker never imported stalwart
        wait_for(lambda: mp_queue.empty(), 20, "the server to read the queue")
        server.stop()
        server._run_watchdog()  # whatever was still in flight
        assert alive(stranger)
        assert server.dropped >= 5 + 500  # the malformed items and the leak beyond the cap
        held = [key for key in server._timers]
        assert len(held) == MAX_TIMERS_PER_PID
        assert all(pid == os.getppid() for pid, _ in held)
    finally:
        server.stop()
        if worker.is_alive():
            worker.kill()
        worker.join(timeout=10)
        os.kill(stranger, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_hostile_signal_names_are_skipped_and_workers_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from stalwart.compat.torch_elastic.multiprocessing import DefaultLogsSpecs, start_processes
    from stalwart.compat.torch_elastic.multiprocessing.api import _terminate_process_handler

    # SIGKILL cannot be caught (signal.signal raises), SIG_IGN is a handler constant
    # equal to SIGHUP, NSIG is no signal; SIGUSR2 is the one that must be handled.
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGKILL,SIG_IGN,NSIG,,SIGUSR2")
    before = signal.getsignal(signal.SIGUSR2)
    try:
        with caplog.at_level(logging.INFO, "stalwart.launch.workers.torch_processes"):
            pc = start_processes(
                name="sig",
                entrypoint=sys.executable,
                args={0: ("-c", "print('ran')")},
                envs={0: {}},
                logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
            )
            result = pc.wait(timeout=40, period=0.05)
            pc.close()
        assert signal.getsignal(signal.SIGUSR2) is _terminate_process_handler
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert result is not None and not result.is_failed()
    text = caplog.text
    assert "Registered signal handler for SIGUSR2" in text
    for name in ("SIGKILL", "'SIG_IGN'", "'NSIG'"):
        assert name in text and "not handled" in text, name
    assert signal.getsignal(signal.SIGHUP) is not _terminate_process_handler
