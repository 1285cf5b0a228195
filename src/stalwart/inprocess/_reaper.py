"""Monitor process body: kills its parent rank when the hard progress timeout passes.

Runs as a separate interpreter (started by ``monitor_process.MonitorProcess``)
with the standard library and ``stalwart.base`` only, so it starts in tens of
milliseconds and keeps working while the rank's interpreter is stuck, even with
the GIL held.  It reads the progress clock described in ``progress.py``; it
exits when the clock is closed or its parent is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import mmap
import os
import signal
import struct
import sys
import time

# Started by path in an isolated interpreter (``-I``): the package this file belongs to
# is importable from wherever it was loaded, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))

from stalwart.base.procs import parent_is

LAYOUT = struct.Struct("<dddd")


def _terminate(pid: int, grace: float, interval: float, log: logging.Logger) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not parent_is(pid):
            return
        time.sleep(min(interval, 0.05))
    log.warning("rank pid %d ignored SIGTERM for %.1fs; sending SIGKILL", pid, grace)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--clock", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--interval", type=float, required=True)
    parser.add_argument("--hard-timeout", type=float, required=True)
    parser.add_argument("--grace", type=float, required=True)
    parser.add_argument("--logfile", default=None)
    parser.add_argument("--ready-fd", type=int, default=None)
    args = parser.parse_args(argv)
    # The rank's stderr hears only of trouble; the log file, when asked for, of everything.
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(logging.WARNING)
    handlers: list[logging.Handler] = [stderr]
    if args.logfile:
        handlers.append(logging.FileHandler(args.logfile))
    logging.basicConfig(
        level=logging.INFO,
        format=f"[stalwart monitor rank {args.rank}] %(asctime)s %(message)s",
        handlers=handlers,
    )
    log = logging.getLogger("stalwart.inprocess.monitor_process")
    # The rank's own signals (Ctrl-C to the process group) are not ours to die of.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(args.clock, "r+b") as f:
        clock = mmap.mmap(f.fileno(), LAYOUT.size)
    # Both wordings NVIDIA's monitor used for the rank it watches (0.2: training_pid,
    # 0.4: target_pid), so log readers written for either find it.
    log.info(
        "monitor_process %d watches training_pid=%d target_pid=%d (hard timeout %.2fs)",
        os.getpid(),
        args.parent,
        args.parent,
        args.hard_timeout,
    )
    if args.ready_fd is not None:
        # The rank waits for this before ending us, so the start line is never lost.
        with contextlib.suppress(OSError):
            os.write(args.ready_fd, b"1")
            os.close(args.ready_fd)
    try:
        while True:
            time.sleep(args.interval)
            if not parent_is(args.parent):
                # The rank died without closing its clock (SIGKILL): remove it for them.
                with contextlib.suppress(OSError):
                    os.unlink(args.clock)
                return 0
            auto, manual, armed, closed = LAYOUT.unpack_from(clock, 0)
            if closed:
                return 0
            last = manual if armed else auto
            age = time.monotonic() - last
            if age > args.hard_timeout:
                log.error(
                    "no progress for %.2fs (hard timeout %.2fs): terminating rank pid %d",
                    age,
                    args.hard_timeout,
                    args.parent,
                )
                _terminate(args.parent, args.grace, args.interval, log)
                with contextlib.suppress(OSError):
                    os.unlink(args.clock)
                return 0
    finally:
        clock.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
