"""NVIDIA's per-rank monitor process, for code that starts one itself (issue 26, seed 004):
`RankMonitorServer.run_in_subprocess(cfg, ipc_socket_path)` with a `FaultToleranceConfig`
(stalwart.monitor.ft_config).

Under `stalwart run` the launcher's node monitor watches every rank; this is for code
written against NVIDIA's package that runs its own monitor per rank (its unit tests, a
home-grown launcher). The rank finds it through NVIDIA's variable
(FT_RANK_MONITOR_IPC_SOCKET, the path given here), as NVIDIA's does. What lies at that
path is not a socket but a one-slot stalwart monitor segment (0600, this user's), which
the rank's `RankMonitorClient` writes exactly as under `stalwart run`: no message per
heartbeat. The configured timeouts go beside it in `<path>.timeouts.json`, with the
config's `safety_factor`, which the rank's client learns its timeouts with (NVIDIA's
client takes it from the config its server sends). The monitor
process judges the slot with `judge.judge`, signals a rank that missed a deadline once
with `rank_termination_signal`, forgets a rank whose process is gone (so the next rank
can attach), and removes both files when it is terminated or its parent dies.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import mmap
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stalwart.base import procs
from stalwart.monitor import judge, layout
from stalwart.monitor.config import MonitorConfig
from stalwart.monitor.ft_config import FaultToleranceConfig, judged
from stalwart.monitor.timeouts_in_force import Configured

log = logging.getLogger(__name__)

#: Suffix of the file beside the segment that holds the configured timeouts.
TIMEOUTS_SUFFIX = ".timeouts.json"
#: Largest configured-timeouts file a rank reads back (a section table of ~1000 names).
MAX_TIMEOUTS_BYTES = 64 * 1024
#: The key of the side file that holds the config's safety factor.
SAFETY_FACTOR_KEY = "safety_factor"


def timeouts_path(segment: str | Path) -> Path:
    return Path(f"{segment}{TIMEOUTS_SUFFIX}")


def _check_ours(path: Path) -> None:
    """Refuses a path this user does not own or that is no regular file: a stranger
    could otherwise hand a rank a segment it controls."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(
            f"{path} is not a regular file of this user (uid {info.st_uid}, mode "
            f"{stat.filemode(info.st_mode)}); refusing to use it as a monitor segment"
        )


def _remove(path: Path) -> None:
    """Removes a leftover of an earlier monitor at `path`, only if it is this user's."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if info.st_uid != os.getuid():
        raise PermissionError(f"{path} exists and belongs to uid {info.st_uid}; not removing it")
    os.unlink(path)


def side_file(configured: Configured, safety_factor: float) -> bytes:
    """What goes beside the segment: the configured timeouts and the safety factor."""
    return json.dumps(
        {**json.loads(configured.to_json()), SAFETY_FACTOR_KEY: safety_factor}
    ).encode()


def safety_factor_in(raw: str) -> float | None:
    """The safety factor a side file holds, or None (none, or not a finite number > 0:
    the rank keeps its own)."""
    try:
        value = json.loads(raw).get(SAFETY_FACTOR_KEY)
    except (ValueError, AttributeError):
        return None  # Configured.from_json says so already
    if value is None:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and math.isfinite(value) and value > 0:
        return float(value)
    log.warning("ignoring the monitor's safety factor %.80r: expected a finite number > 0", value)
    return None


def attach(path: str) -> tuple[mmap.mmap, Configured, float | None]:
    """A rank's side: the segment at `path`, and the configured timeouts and safety
    factor beside it (None: the rank's own)."""
    segment = Path(path)
    _check_ours(segment)
    mm, _ = layout.open_segment(segment)
    side = timeouts_path(segment)
    try:
        _check_ours(side)
        with open(side, "rb") as f:
            raw = f.read(MAX_TIMEOUTS_BYTES + 1)
    except FileNotFoundError:
        return mm, Configured(), None
    if len(raw) > MAX_TIMEOUTS_BYTES:
        raise ValueError(f"{side} is larger than {MAX_TIMEOUTS_BYTES} bytes")
    text = raw.decode("utf-8", errors="replace")
    return mm, Configured.from_json(text), safety_factor_in(text)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class MonitorProcess:
    """The monitor's process, with the calls NVIDIA's callers make on the
    `multiprocessing.Process` its `run_in_subprocess` returns."""

    def __init__(self, popen: subprocess.Popen[bytes], segment: Path) -> None:
        self._popen = popen
        self._segment = segment

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def terminate(self) -> None:
        if self._popen.poll() is None:
            self._popen.terminate()

    def kill(self) -> None:
        if self._popen.poll() is None:
            self._popen.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)
        if self._popen.returncode is not None:
            # The monitor removes its files itself, unless it was ended before it could
            # (terminated during its start, killed).
            for leftover in (self._segment, timeouts_path(self._segment)):
                with contextlib.suppress(OSError):
                    _remove(leftover)


class RankMonitorServer:
    """Starts the monitor of one rank in a process of its own."""

    @classmethod
    def run_in_subprocess(
        cls,
        cfg: FaultToleranceConfig,
        ipc_socket_path: str,
        is_restarter_logger: bool = False,
        mp_ctx: Any = None,
    ) -> MonitorProcess:
        """Creates the segment at `ipc_socket_path` and starts its monitor; returns the
        process (terminate it to stop monitoring; it removes its files).

        The monitor is a fresh interpreter running only this module, whatever `mp_ctx`
        says: a multiprocessing child would run the caller's script again where it has
        no `__main__` guard.
        """
        del is_restarter_logger, mp_ctx  # NVIDIA's restart log; see above
        judged = cfg.monitor_config()
        configured = cfg.configured()
        segment = Path(ipc_socket_path)
        _remove(segment)
        _remove(timeouts_path(segment))
        layout.create_segment(segment, 1).close()
        _write_private(timeouts_path(segment), side_file(configured, cfg.safety_factor))
        argv = [
            sys.executable,
            "-m",
            __name__,
            str(segment),
            str(os.getpid()),
            str(judged.check_interval),
            str(int(judged.term_signal)),
        ]
        try:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        except OSError:
            _remove(segment)
            _remove(timeouts_path(segment))
            raise
        return MonitorProcess(popen, segment)


def main(argv: list[str]) -> int:
    """`python -m stalwart.monitor.nvidia_server SEGMENT PARENT_PID INTERVAL SIGNAL`."""
    logging.basicConfig(level=logging.INFO, format="stalwart rank monitor: %(message)s")
    path, parent, interval, signum = argv
    _, configured, _ = attach(path)
    config = judged(configured, float(interval), signal.Signals(int(signum)))
    serve(path, config, int(parent))
    return 0


def serve(path: str, config: MonitorConfig, parent: int) -> None:
    """The monitor process: judges the slot until terminated or orphaned."""

    def on_term(signum: int, frame: object) -> None:
        # Out of the sleep at once; the finally below removes the files.
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    segment = Path(path)
    mm, _ = layout.open_segment(segment)
    floor = time.monotonic()
    signalled: tuple[int, float] | None = None  # (pid, attach time) already signalled
    try:
        while os.getppid() == parent:
            now = time.monotonic()
            snap = layout.read_slot(mm, 0)
            wait = config.check_interval
            if snap.state == layout.SlotState.ATTACHED and snap.pid > 0:
                if not procs.is_alive(snap.pid):
                    # Detach the dead rank unless a new one has begun to attach (its
                    # first write zeroes the pid): never wipe what a newcomer wrote.
                    base = layout.slot_offset(0)
                    if layout.I64.unpack_from(mm, base + layout.OFF_PID)[0] == snap.pid:
                        layout.I64.pack_into(mm, base + layout.OFF_STATE, layout.SlotState.DETACHED)
                    continue
                names = layout.read_names(mm, 0, max(0, min(snap.name_count, layout.MAX_SECTIONS)))
                verdict = judge.judge(snap, names, config, now, floor)
                if verdict is not None and signalled != (snap.pid, snap.attach_time):
                    log.warning(
                        "rank pid %d missed its %s deadline (%.1f s): sending %s",
                        snap.pid,
                        verdict.kind,
                        verdict.timeout,
                        config.term_signal.name,
                    )
                    # Gone meanwhile, or not ours to signal: either way nothing to do.
                    with contextlib.suppress(OSError):
                        os.kill(snap.pid, config.term_signal)
                    signalled = (snap.pid, snap.attach_time)
                due = judge.next_deadline(snap, names, config, now, floor)
                if due is not None and verdict is None:
                    wait = min(wait, max(0.01, due - now + 0.01))
            time.sleep(wait)
    finally:
        mm.close()
        for leftover in (segment, timeouts_path(segment)):
            with contextlib.suppress(OSError):
                _remove(leftover)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
