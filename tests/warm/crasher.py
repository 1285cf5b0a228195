"""Fails with an uncaught exception while leaving work for the interpreter's shutdown: a
non-daemon thread still running, an atexit handler, a file with unflushed data, and an
object whose ``__del__`` takes 30 s (a stand-in for a long interpreter teardown).
Never imports stalwart; no ``__main__`` guard.

    crasher.py OUT_DIR
"""

import atexit
import sys
import threading
import time
from pathlib import Path

OUT = Path(sys.argv[1])


class SlowToFree:
    def __del__(self) -> None:
        time.sleep(30)


def late_thread() -> None:
    time.sleep(0.3)
    (OUT / "thread_done").write_text("1")


leftover = SlowToFree()
atexit.register(lambda: (OUT / "atexit_ran").write_text("1"))
unflushed = open(OUT / "unflushed.txt", "w")  # noqa: SIM115 - left open on purpose
unflushed.write("written before the crash\n")
threading.Thread(target=late_thread).start()
(OUT / "fault").write_text(repr(time.time()))
raise RuntimeError("crashing on purpose")
