"""Fails while leaving work for the interpreter's shutdown: a thread pool with queued
tasks, a non-daemon thread still running, an atexit handler, a file and a C stdio
buffer with unflushed data, and an object whose ``__del__`` takes 60 s (a stand-in for a
long interpreter teardown).  Never imports stalwart; no ``__main__`` guard.

    crasher.py OUT_DIR raise|exit|interrupt
"""

import atexit
import ctypes
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

OUT = Path(sys.argv[1])
HOW = sys.argv[2]


class SlowToFree:
    def __del__(self) -> None:
        time.sleep(60)


def late_thread() -> None:
    time.sleep(0.3)
    (OUT / "thread_done").write_text("1")


def task(i: int) -> None:
    time.sleep(0.1)
    (OUT / f"task_{i}").write_text("1")


def after_the_others() -> None:
    # atexit runs after threading's shutdown: the pool's work and the thread are done.
    done = sorted(p.name for p in OUT.iterdir() if p.name.startswith(("task_", "thread_")))
    (OUT / "atexit_saw").write_text(",".join(done))


leftover = SlowToFree()
atexit.register(after_the_others)
unflushed = open(OUT / "unflushed.txt", "w")  # noqa: SIM115 - left open on purpose
unflushed.write("written before the crash\n")
ctypes.CDLL(None).printf(b"from C before the crash\n")
pool = ThreadPoolExecutor(max_workers=1)
for i in range(3):
    pool.submit(task, i)
threading.Thread(target=late_thread).start()
(OUT / "fault").write_text(repr(time.time()))
if HOW == "exit":
    sys.exit("exiting on purpose")
if HOW == "interrupt":
    raise KeyboardInterrupt
raise RuntimeError("crashing on purpose")
