"""Where worker output goes: redirect to files, tee to the console with a prefix.

Layout per attempt and local rank, as torchrun's::

    <log_dir>/<run_id>/attempt_<n>/<local_rank>/{stdout.log,stderr.log,error.json}

Redirection happens at the file-descriptor level (the child's fd 1/2 *are* the files),
so output from C extensions is captured too.  Tee is redirect + one thread that tails
the files and copies whole lines to the console with a prefix; when the workers stop it
drains the files, including a last line without a newline, so nothing a crashing worker
wrote is lost.  The local-ranks filter limits only what reaches the console.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import stat
import string
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

# The settings' vocabulary is config's; Std stays importable from here as before.
from stalwart.config.output import DEFAULT_PREFIX
from stalwart.config.output import Std as Std

logger = logging.getLogger(__name__)


def std_map(spec: Std | dict[int, Std], nprocs: int) -> dict[int, Std]:
    if isinstance(spec, Std):
        return dict.fromkeys(range(nprocs), spec)
    return {r: spec.get(r, Std.NONE) for r in range(nprocs)}


def render_prefix(template: str, *, rank: int, local_rank: int, role: str, node_rank: int) -> str:
    """torchrun's ``${rank}``, ``${local_rank}``, ``${role_name}``, ``${node_rank}``, plus
    ``${hostname}``."""
    return string.Template(template).safe_substitute(
        rank=rank,
        local_rank=local_rank,
        role_name=role,
        node_rank=node_rank,
        hostname=socket.gethostname(),
    )


@dataclass
class WorkerLogs:
    """Where one worker's streams go.  ``None`` means inherit the launcher's stream."""

    stdout: Path | None
    stderr: Path | None
    error_file: Path | None
    tee_stdout: bool = False
    tee_stderr: bool = False
    console: bool = True  # False: output not redirected to a file goes to /dev/null
    prefix: str = ""


@dataclass
class LogSpec:
    """How a run's worker output is handled; turns into per-rank ``WorkerLogs``."""

    run_dir: Path | None  # <log_dir>/<run_id>; None: no files at all (log_dir=/dev/null)
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    local_ranks_filter: set[int] | None = None
    prefix_template: str = DEFAULT_PREFIX

    def attempt_dir(self, attempt: int) -> Path | None:
        return None if self.run_dir is None else self.run_dir / f"attempt_{attempt}"

    def make(
        self, attempt: int, nprocs: int, ranks: dict[int, int], role: str, node_rank: int
    ) -> dict[int, WorkerLogs]:
        """Creates the attempt's folders (wiping a stale one) and returns per-rank plans."""
        adir = self.attempt_dir(attempt)
        if adir is not None:
            shutil.rmtree(adir, ignore_errors=True)
            adir.mkdir(parents=True)
        redirs = std_map(self.redirects, nprocs)
        tees = std_map(self.tee, nprocs)
        out: dict[int, WorkerLogs] = {}
        for lr in range(nprocs):
            # Tee is implemented as redirect + tail, so a tee'd stream is also redirected.
            rd = redirs[lr] | tees[lr]
            on_console = self.local_ranks_filter is None or lr in self.local_ranks_filter
            wdir = None if adir is None else adir / str(lr)
            if wdir is not None:
                wdir.mkdir()
            out[lr] = WorkerLogs(
                stdout=wdir / "stdout.log" if wdir is not None and rd & Std.OUT else None,
                stderr=wdir / "stderr.log" if wdir is not None and rd & Std.ERR else None,
                error_file=wdir / "error.json" if wdir is not None else None,
                tee_stdout=bool(tees[lr] & Std.OUT) and on_console and wdir is not None,
                tee_stderr=bool(tees[lr] & Std.ERR) and on_console and wdir is not None,
                console=on_console,
                prefix=render_prefix(
                    self.prefix_template,
                    rank=ranks[lr],
                    local_rank=lr,
                    role=role,
                    node_rank=node_rank,
                ),
            )
        return out


# How much of a file the tee reads at once, how far the console may fall behind the file
# before lines are skipped on the console (the file keeps them all), and the longest line
# it holds while waiting for its end.  Together they bound its memory to a few MiB
# whatever the workers print and however slowly the console drains.
_CHUNK = 1 << 20
MAX_BACKLOG = 16 << 20
_MAX_LINE = 64 << 10

# A tailed path is opened once, without following a link and without waiting for a
# writer (a FIFO planted there would otherwise block the open for good), and only a
# regular file is read; later renames or replacements of the path are not followed.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass
class _Tailed:
    path: Path
    sink: IO[str]
    prefix: str
    line_filter: Callable[[str], bool] | None = None
    fd: int | None = None
    offset: int = 0
    partial: bytes = b""
    refused: bool = False


class Tee:
    """One thread that copies new lines of several log files to the console, prefixed.

    The copy is bounded: when the console falls more than ``max_backlog`` bytes behind a
    file, the lines in between are skipped on the console with one line saying how many
    and where they are (the file has every line, since the worker writes to it).  A path
    that is a link, a FIFO, a device or a folder is refused once, with one log line."""

    def __init__(self, interval: float = 0.05, max_backlog: int = MAX_BACKLOG) -> None:
        self._files: list[_Tailed] = []
        self._interval = interval
        self._max_backlog = max_backlog
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def add(
        self,
        path: Path,
        sink: IO[str],
        prefix: str,
        line_filter: Callable[[str], bool] | None = None,
    ) -> None:
        """*line_filter*, when given, sees each line (with its newline, as ``readline``
        returns it) and only the lines it accepts are copied."""
        with self._lock:
            self._files.append(_Tailed(path, sink, prefix, line_filter))

    def start(self) -> None:
        if self._files and self._thread is None:
            self._thread = threading.Thread(target=self.run, name="stalwart-tee", daemon=True)
            self._thread.start()

    def run(self) -> None:
        """Copies until ``stop()`` is called (the body of the tee's thread; a caller that
        owns a thread of its own may run it there instead of calling ``start()``)."""
        while not self._stop.wait(self._interval):
            self._pump(final=False)

    def _pump(self, final: bool) -> None:
        with self._lock:
            if not final and self._stop.is_set():
                return  # stop() drained and closed the files: nothing may reopen them
            for t in self._files:
                if t.refused:
                    continue
                if t.fd is None:
                    t.fd = self._open(t)
                    if t.fd is None:
                        continue
                try:
                    self._copy(t, t.fd, final)
                except OSError as e:
                    self._refuse(t, f"read failed ({e.strerror or e})")

    def _open(self, t: _Tailed) -> int | None:
        try:
            fd = os.open(t.path, _OPEN_FLAGS)
        except FileNotFoundError:
            return None  # not written yet
        except OSError as e:
            # ELOOP: the last component is a symbolic link.
            what = "a symbolic link" if e.errno == errno.ELOOP else (e.strerror or str(e))
            self._refuse(t, what)
            return None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            self._refuse(t, f"not a regular file (mode {stat.filemode(mode)})")
            return None
        return fd

    @staticmethod
    def _refuse(t: _Tailed, why: str) -> None:
        t.refused = True
        if t.fd is not None:
            os.close(t.fd)
            t.fd = None
        logger.error("log file %s is not copied: %s", t.path, why)

    def _copy(self, t: _Tailed, fd: int, final: bool) -> None:
        # A few chunks per file per round while running, so that one chatty rank does not
        # starve the others; everything (up to the backlog bound) at the end.
        rounds = None if final else 4
        while rounds is None or rounds > 0:
            size = os.fstat(fd).st_size
            if size < t.offset:  # truncated under us: what is there now is new
                t.offset, t.partial = 0, b""
            if size - t.offset > self._max_backlog:
                self._skip(t, fd, size - self._max_backlog // 2)
            chunk = os.pread(fd, _CHUNK, t.offset)
            if not chunk:
                break
            t.offset += len(chunk)
            lines = (t.partial + chunk).split(b"\n")
            t.partial = lines.pop()
            if len(t.partial) > _MAX_LINE:  # a line without end: show it in pieces
                lines.append(t.partial)
                t.partial = b""
            self._write(t, lines, ended=True)
            if t.refused:
                return
            if rounds is not None:
                rounds -= 1
        if final and t.partial:
            self._write(t, [t.partial], ended=False)  # a crash mid-line: keep what was written
            t.partial = b""

    def _skip(self, t: _Tailed, fd: int, target: int) -> None:
        """Moves *t* to the first line start at or after *target*, counting the lines
        passed over (reading in chunks: nothing is held)."""
        dropped = 0  # a line begun in t.partial is counted at its end below
        t.partial = b""
        start = pos = t.offset
        while True:
            chunk = os.pread(fd, _CHUNK, pos)
            if not chunk:
                break
            if pos + len(chunk) < target:
                dropped += chunk.count(b"\n")
                pos += len(chunk)
                continue
            cut = max(0, target - pos)
            dropped += chunk.count(b"\n", 0, cut)
            nl = chunk.find(b"\n", cut)
            if nl >= 0:
                dropped += 1
                pos += nl + 1
                break
            pos += len(chunk)  # no line end yet: keep looking
        t.offset = pos
        if pos > start:
            self._write_text(
                t,
                f"{t.prefix}[stalwart: {dropped} line(s) not shown ({pos - start} bytes), "
                f"the console fell behind; all are in {t.path}]\n",
            )

    def _write(self, t: _Tailed, lines: list[bytes], ended: bool) -> None:
        texts = [ln.decode("utf-8", "replace") + ("\n" if ended else "") for ln in lines]
        if t.line_filter is not None:
            try:
                texts = [tx for tx in texts if t.line_filter(tx)]
            except Exception as e:  # the filter is the caller's code: stop using it, say why
                self._refuse(t, f"its line filter raised {e!r}")
                return
        if texts:
            self._write_text(
                t, "".join(t.prefix + (tx if tx.endswith("\n") else tx + "\n") for tx in texts)
            )

    @staticmethod
    def _write_text(t: _Tailed, text: str) -> None:
        try:
            t.sink.write(text)
            t.sink.flush()
        except (OSError, ValueError):
            pass  # a closed console must not stop the job (the files have everything)

    def stopped(self) -> bool:
        """True once nothing is (or will be) copied any more."""
        return self._thread is None

    def stop(self) -> None:
        """Stops the thread, copies whatever is left in the files and closes them."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._pump(final=True)
        with self._lock:
            for t in self._files:
                if t.fd is not None:
                    os.close(t.fd)
                    t.fd = None
