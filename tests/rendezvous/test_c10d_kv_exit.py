"""A launcher whose c10d store host died exits with its own code, not SIGABRT.

A daemon thread that comes back out of TCPStore's C++ code while the interpreter
finalizes is ended inside it and the C++ runtime aborts the process. The program below
(no ``__main__`` guard) is a launcher's use of the store reduced to it: a keep-alive
thread beats the store through ``C10dKV``, the store's host is SIGKILLed, and the
program exits with its own code while beats keep failing."""

from __future__ import annotations

import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from stalwart.rendezvous.api import StoreLost
from stalwart.rendezvous.kv import C10dKV
from tests.helpers import ROOT, clean_env, store_host_process

PROGRAM = """
import os, signal, sys, threading, time
from datetime import timedelta
from torch.distributed import TCPStore
from stalwart.rendezvous.kv import C10dKV

KIDS = 6
port_r, port_w = os.pipe()
gone_r, gone_w = os.pipe()
host = os.fork()
if host == 0:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=60))
    os.write(port_w, b"%d" % store.port)
    time.sleep(60)
    os._exit(0)
port = int(os.read(port_r, 32))
kids = []
for _ in range(KIDS):
    pid = os.fork()
    if pid == 0:
        kv = C10dKV("127.0.0.1", port, is_host=False, connect_timeout=10, op_timeout=5)
        kv.add("ready", 1)

        def beat():
            while True:
                try:
                    kv.add("beat", 1)
                except Exception:
                    pass

        for _ in range(2):
            threading.Thread(target=beat, daemon=True).start()
        os.read(gone_r, 1)
        time.sleep(0.2)
        sys.exit(3)
    kids.append(pid)
probe = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
probe.wait(["beat"])
while probe.add("ready", 0) < KIDS:
    time.sleep(0.01)
os.kill(host, signal.SIGKILL)
os.waitpid(host, 0)
os.write(gone_w, b"x" * KIDS)
print("CODES", [os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids], flush=True)
"""


@pytest.mark.timeout(60)
def test_losing_the_store_host_ends_in_the_launchers_code_not_sigabrt(tmp_path: Path) -> None:
    script = tmp_path / "lost_store.py"
    script.write_text(PROGRAM)
    # Six exits (forks: one torch import): the old code aborted in about two of three.
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True, text=True, timeout=50, env=clean_env(), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-2000:]
    assert "CODES [3, 3, 3, 3, 3, 3]" in proc.stdout, (proc.stdout, proc.stderr[-2000:])


def test_a_closed_client_makes_no_more_store_calls() -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))  # fmt: skip
    kv = C10dKV("127.0.0.1", server.port, is_host=False, connect_timeout=5, op_timeout=5)
    assert kv.add("n", 2) == 2
    start = time.monotonic()
    kv.close()
    kv.close()  # twice: nothing more to do
    with pytest.raises(StoreLost, match="is closed"):
        kv.add("n", 1)
    assert time.monotonic() - start < 2.0
    assert server.add("n", 0) == 2  # the refused call never reached the store


class _Counted:
    """The real store, counting the calls that reach it."""

    def __init__(self, store: TCPStore) -> None:
        self.store = store
        self.calls = 0

    def add(self, key: str, amount: int) -> int:
        self.calls += 1
        return int(self.store.add(key, amount))


@pytest.mark.timeout(60)
def test_after_the_store_host_dies_no_call_reaches_the_dead_connection() -> None:
    # torch's client never reconnects, and each failed call resolves the socket's
    # addresses through reverse DNS: calls after the first failure only load the resolver.
    with store_host_process() as (host, port):
        kv = C10dKV("127.0.0.1", port, is_host=False, connect_timeout=10, op_timeout=5)
        counted = _Counted(kv.store)
        kv.store = counted  # type: ignore[assignment]
        assert kv.add("n", 1) == 1
        host.kill()
        host.wait(timeout=30)
        with pytest.raises(StoreLost, match="lost the c10d rendezvous store"):
            kv.add("n", 1)
        reached = counted.calls
        depths = []
        for _ in range(20):
            with pytest.raises(StoreLost, match="lost the c10d rendezvous store") as caught:
                kv.add("n", 1)
            depths.append(len(traceback.extract_tb(caught.value.__traceback__)))
        assert counted.calls == reached == 2
        # The same error raised again does not carry every earlier raise's frames.
        assert depths[-1] == depths[0], depths
        kv.close()
