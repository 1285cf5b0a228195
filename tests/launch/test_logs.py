"""Per-attempt log folders, fd-level redirect, tee with prefixes, the local-ranks filter."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import tracemalloc
from pathlib import Path

import pytest

from stalwart.launch.files.logs import MAX_BACKLOG, Tee
from tests.helpers import events, run_dir, stalwart, wait_for, warm_and_cold

from .helpers import SCRIPTS

pytestmark = pytest.mark.timeout(60)


@warm_and_cold
def test_redirect_captures_python_fd_and_child_output(tmp_path: Path) -> None:
    proc = stalwart(
        "--nproc-per-node", "2", "-r", "3", "--log-dir", tmp_path, SCRIPTS / "output.py"
    )
    assert proc.returncode == 0, proc.stderr
    d = run_dir(tmp_path) / "attempt_0"
    out1 = (d / "1" / "stdout.log").read_text()
    assert "py-out rank=1" in out1 and "fd-out rank=1" in out1 and "c-out rank=1" in out1
    assert (d / "1" / "stderr.log").read_text() == "py-err rank=1\n"
    assert "py-out" not in proc.stdout  # redirected, not tee'd


@warm_and_cold
def test_tee_prefixes_filter_and_crash_mid_line(tmp_path: Path) -> None:
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "-t",
        "3",
        "--local-ranks-filter",
        "1",
        "--log-line-prefix-template",
        "<${role_name}:${rank}> ",
        "--log-dir",
        tmp_path,
        SCRIPTS / "output.py",
        "die-mid-line",
        tmp_path.parent / (tmp_path.name + "-ready"),
    )
    assert proc.returncode == 1
    assert "<default:1> py-out rank=1" in proc.stdout
    assert "<default:1> unterminated rank=1" in proc.stdout  # the partial last line survives
    assert "rank=0" not in proc.stdout  # filtered from the console ...
    d = run_dir(tmp_path) / "attempt_0"
    assert "unterminated rank=0" in (d / "0" / "stdout.log").read_text()  # ... but in its file


@warm_and_cold
def test_default_prefix_is_torchruns_role_and_local_rank(tmp_path: Path) -> None:
    proc = stalwart(
        "--nproc-per-node", "2", "-t", "1", "--log-dir", tmp_path, SCRIPTS / "output.py"
    )
    assert proc.returncode == 0, proc.stderr
    assert "[default0]:py-out rank=0" in proc.stdout and "[default1]:fd-out rank=1" in proc.stdout
    evs = events(tmp_path)
    ipc = next(e for e in evs if e["event"] == "monitor_started")["run_dir"]
    assert not Path(ipc).exists()  # nothing left in /tmp after a normal run


@warm_and_cold
def test_attempt_folders_per_restart(tmp_path: Path) -> None:
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "-r",
        "3",
        "--max-restarts",
        "1",
        "--log-dir",
        tmp_path,
        SCRIPTS / "output.py",
        "die-mid-line",
        tmp_path.parent / (tmp_path.name + "-ready"),
    )
    assert proc.returncode == 1
    rd = run_dir(tmp_path)
    for attempt in (0, 1):
        for lr in (0, 1):
            assert (rd / f"attempt_{attempt}" / str(lr) / "stdout.log").is_file()


class _CountingConsole:
    """A console that keeps counts, not text (so that only the tee's memory is measured);
    with *gate* it blocks each write until the gate opens (a stalled terminal)."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.entered = threading.Event()
        self.lines = 0
        self.chars = 0
        self.notices: list[str] = []

    def write(self, text: str) -> int:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        for line in text.splitlines():
            if "[stalwart:" in line:
                self.notices.append(line)
            else:
                self.lines += 1
        self.chars += len(text)
        return len(text)

    def flush(self) -> None:
        pass


def _write_lines(path: Path, n: int, start: int = 0) -> None:
    with open(path, "ab") as fh:  # in pieces: the test's own memory is measured too
        for lo in range(start, start + n, 10_000):
            hi = min(lo + 10_000, start + n)
            fh.write(b"".join(b"line %09d %s\n" % (i, b"x" * 80) for i in range(lo, hi)))


def _dropped(notices: list[str]) -> int:
    return sum(int(re.search(r"(\d+) line\(s\) not shown", n).group(1)) for n in notices)  # type: ignore[union-attr]


def test_tee_memory_is_bounded_and_drops_are_counted(tmp_path: Path) -> None:
    """40 MB of backlog: the tee holds a few MiB, never the backlog (it used to read it
    whole), and every line is either shown or counted as not shown."""
    log = tmp_path / "stdout.log"
    total = 400_000
    _write_lines(log, total)
    console = _CountingConsole()
    tee = Tee()
    tee.add(log, console, "[0]:")  # type: ignore[arg-type]
    tracemalloc.start()
    try:
        tee.stop()  # the final drain
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"tee peak {peak / (1 << 20):.1f} MiB"
    assert len(console.notices) == 1 and str(log) in console.notices[0]
    assert console.lines + _dropped(console.notices) == total
    assert console.chars < MAX_BACKLOG + (1 << 20)
    assert log.stat().st_size == total * 96  # the file copy is whole


def test_tee_with_a_stalled_console_keeps_memory_and_the_file(tmp_path: Path) -> None:
    log = tmp_path / "stdout.log"
    gate = threading.Event()
    console = _CountingConsole(gate)
    tee = Tee(interval=0.01)
    tee.add(log, console, "[0]:")  # type: ignore[arg-type]
    _write_lines(log, 10)
    tee.start()
    tracemalloc.start()
    try:
        # The tee is stuck writing the first lines to the console while the worker goes on.
        assert console.entered.wait(10)
        for k in range(4):
            _write_lines(log, 100_000, 10 + k * 100_000)
        gate.set()
        tee.stop()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        gate.set()
        tracemalloc.stop()
    assert peak < 8 << 20, f"tee peak {peak / (1 << 20):.1f} MiB"
    assert console.lines + _dropped(console.notices) == 400_010
    assert console.notices, "a console that fell behind is told how many lines it missed"
    with open(log, "rb") as fh:
        assert sum(1 for _ in fh) == 400_010


def test_tee_never_blocks_on_a_fifo_nor_follows_a_swapped_link(tmp_path: Path) -> None:
    """A worker can replace its own log file: a FIFO there used to block the tee's open
    (and the launcher's stop) for good; a link there used to be followed at each round."""
    fifo, swapped, secret = tmp_path / "0.log", tmp_path / "1.log", tmp_path / "secret"
    os.mkfifo(fifo)
    secret.write_text("SECRET\n" * 100)
    swapped.write_text("before\n")
    console = _CountingConsole()
    tee = Tee(interval=0.01)
    tee.add(fifo, console, "[0]:")  # type: ignore[arg-type]
    tee.add(swapped, console, "[1]:")  # type: ignore[arg-type]
    tee.start()
    try:
        wait_for(lambda: console.lines >= 1, timeout=10, what="the first line")
        link = tmp_path / "link"
        link.symlink_to(secret)
        os.replace(link, swapped)
        stopper = threading.Thread(target=tee.stop, daemon=True)
        stopper.start()
        stopper.join(10)
        assert not stopper.is_alive(), "the tee blocked on a FIFO"
    finally:
        # Releases an old tee blocked in open(): a writer appears, then leaves (ENXIO:
        # nobody is reading, nothing to release).
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert console.lines == 1  # "before" only: the link's target was never read


@pytest.mark.parametrize(
    ("entrypoint", "reader"), [("program", True), ("program", False), ("function", True)]
)
def test_a_fifo_planted_at_a_worker_log_neither_blocks_nor_is_written_through(
    tmp_path: Path, entrypoint: str, reader: bool
) -> None:
    """A stranger who can write to the log folder plants a FIFO at rank 1's stdout.log,
    reading from it or not: the start is refused in one line naming the path, at once,
    nothing reaches the FIFO, and rank 0, already started, does not outlive the error."""
    import sys

    import psutil

    from stalwart.launch.files.logs import LogSpec, Std
    from stalwart.launch.workers.processes import start_processes

    from . import funcs

    logs = LogSpec(tmp_path / "run", redirects=Std.ALL).make(0, 2, {0: 0, 1: 1}, "default", 0)
    fifo = logs[1].stdout
    assert fifo is not None
    os.mkfifo(fifo)
    marker = f"planted-{os.getpid()}-{entrypoint}"
    read_end = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK) if reader else None
    refused: list[BaseException] = []

    def start() -> None:
        try:
            if entrypoint == "program":
                code = f"import time; print('{marker}', flush=True); time.sleep(60)"
                start_processes(
                    sys.executable,
                    {0: ("-c", code), 1: ("-c", code)},
                    {0: {}, 1: {}},
                    logs,
                )
            else:
                start_processes(
                    funcs.square, {0: (3,), 1: (4,)}, {0: {}, 1: {}}, logs, start_method="fork"
                )
        except BaseException as exc:  # the test reads what was raised
            refused.append(exc)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    starter.join(20)
    try:
        assert not starter.is_alive(), "the start blocked on the FIFO"
        (exc,) = refused
        assert isinstance(exc, ValueError), exc
        # With a reader the open succeeds and the file type refuses it; without one the
        # non-blocking open fails at once (ENXIO).
        assert str(exc).startswith(f"worker log '{fifo}'"), exc
        assert "\n" not in str(exc)
        if read_end is not None:
            with contextlib.suppress(BlockingIOError):
                assert os.read(read_end, 1 << 16) == b""
        orphans = [
            p.pid
            for p in psutil.Process().children(recursive=True)
            if marker in " ".join(p.cmdline())
        ]
        assert orphans == []
    finally:
        if read_end is not None:
            os.close(read_end)
        if starter.is_alive():
            # Releases an old launcher blocked in open(): a reader appears, then leaves.
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
