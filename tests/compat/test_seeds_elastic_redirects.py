"""torch elastic's ``redirects`` and ``TailLog`` over stalwart (issue 26 item 4, seed 001):
a redirect catches what a child that never imports stalwart writes to its inherited fds;
a destination or a tailed path that is a FIFO or a link is refused, never blocked on or
followed; a tailed file with a 50 MB line without end or binary bytes keeps the tailer's
memory bounded."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest

from tests.helpers import wait_for

# A program that never imports stalwart: what it writes to the fds it inherited.
CHILD = (
    "import os, sys\n"
    "print('py child out', flush=True)\n"
    "os.write(2, b'fd child err\\n')\n"
    "os.system('echo sh grandchild out')\n"
)


@pytest.mark.timeout(60)
def test_redirect_catches_a_foreign_childs_fd_output(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from stalwart.compat.torch_elastic.multiprocessing.redirects import (
        redirect_stderr,
        redirect_stdout,
    )

    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    err.write_text("stale content from an earlier attempt\n")
    libc = ctypes.CDLL(None)
    with redirect_stdout(str(out)), redirect_stderr(err):
        print("from python")
        libc.printf(b"from c %d\n", 7)  # C stdio: buffered until the switch back
        subprocess.run([sys.executable, "-c", CHILD], check=True, timeout=50)
    print("after the block")
    os.system("echo after from sh")
    assert set(out.read_text().splitlines()) == {
        "from python",
        "from c 7",
        "py child out",
        "sh grandchild out",
    }
    assert err.read_text() == "fd child err\n"  # truncated, as torch's redirect does
    seen = capfd.readouterr().out
    assert "after the block" in seen and "after from sh" in seen
    assert "from python" not in seen and "py child out" not in seen


@pytest.mark.timeout(30)
@pytest.mark.parametrize("planted", ["fifo", "symlink", "folder", "bad-stream"])
def test_redirect_refuses_a_planted_destination_without_blocking(
    tmp_path: Path, planted: str
) -> None:
    from stalwart.compat.torch_elastic.multiprocessing.redirects import redirect

    dst = tmp_path / "stdout.log"
    secret = tmp_path / "secret"
    secret.write_text("keep me\n")
    std, match = "stdout", "expected a regular file"
    if planted == "fifo":
        os.mkfifo(dst)  # no reader: a plain open for writing would wait forever
    elif planted == "symlink":
        dst.symlink_to(secret)
        match = "not a link"
    elif planted == "folder":
        dst.mkdir()
        match = "cannot open it"
    else:
        std, match = "stdfoo", "unknown stream 'stdfoo': expected 'stdout' or 'stderr'"
    before = os.fstat(1)
    with pytest.raises(ValueError, match=match), redirect(std, dst):
        pytest.fail("the block must not run")
    after = os.fstat(1)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    assert secret.read_text() == "keep me\n"


class _Sink:
    """A destination that counts what it got and keeps only the short lines."""

    def __init__(self) -> None:
        self.chars = 0
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self.chars += len(text)
            self.lines.extend(ln for ln in text.splitlines() if len(ln) < 200)
        return len(text)

    def flush(self) -> None:
        pass

    def has(self, needle: str) -> bool:
        with self._lock:
            return any(needle in ln for ln in self.lines)


@pytest.mark.timeout(60)
def test_tail_log_with_hostile_files_stays_bounded_and_never_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from stalwart.compat.torch_elastic.multiprocessing.tail_log import TailLog

    secret = tmp_path / "secret"
    secret.write_text("SECRET line\n" * 1000)
    files = {r: tmp_path / f"{r}.log" for r in range(6)}
    with open(files[0], "wb") as fh:  # one 50 MB line without end
        for _ in range(50):
            fh.write(b"x" * (1 << 20))
    files[1].write_bytes(bytes(range(256)) + b"\nbinary\x00\xff\xfeok\nlast without end")
    os.mkfifo(files[2])  # planted before the start, no writer
    files[3].symlink_to(secret)  # planted before the start
    files[4].write_text("e1\n")  # replaced by a link while tailed
    files[5].write_text("f1\n")  # replaced by a FIFO while tailed

    sink = _Sink()
    caplog.set_level(logging.ERROR)
    tracemalloc.start()
    try:
        logs = {r: str(p) for r, p in files.items()}
        tail = TailLog("w", logs, sink, interval_sec=0.01)  # type: ignore[arg-type]
        tail.start()
        wait_for(lambda: sink.has("[w4]:e1") and sink.has("[w5]:f1"), timeout=20)
        link = tmp_path / "link"
        link.symlink_to(secret)
        os.replace(link, files[4])
        files[5].unlink()
        os.mkfifo(files[5])
        with open(files[4].resolve(), "a") as fh:  # the link's target grows
            fh.write("SECRET after the swap\n")
        stopper = threading.Thread(target=tail.stop, daemon=True)
        stopper.start()
        stopper.join(20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not stopper.is_alive(), "TailLog.stop() blocked"
    assert tail.stopped()
    assert peak < 8 << 20, f"tailer peak {peak / (1 << 20):.1f} MiB"
    assert sink.chars < (16 << 20) + (1 << 20)  # the long line is cut, not copied whole
    assert not sink.has("SECRET")
    assert sink.has("[w1]:binary\x00\ufffd\ufffdok") and sink.has("[w1]:last without end")
    assert sink.has("[w0]:[stalwart: 0 line(s) not shown")
    refused = [r.getMessage() for r in caplog.records if "is not copied" in r.getMessage()]
    assert len(refused) == 2, refused
    assert any(str(files[2]) in m and "regular file" in m for m in refused)
    assert any(str(files[3]) in m and "symbolic link" in m for m in refused)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("planted", ["fifo", "symlink"])
def test_tail_log_refuses_a_planted_destination(tmp_path: Path, planted: str) -> None:
    from stalwart.compat.torch_elastic.multiprocessing.tail_log import TailLog

    dst = tmp_path / "tailed.log"
    if planted == "fifo":
        os.mkfifo(dst)
    else:
        dst.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "0.log").write_text("a\n")
    tail = TailLog("w", {0: str(tmp_path / "0.log")}, str(dst))
    with pytest.raises(ValueError, match=f"TailLog destination {str(dst)!r}"):
        tail.start()
    tail.stop()
    assert tail.stopped()
    assert not (tmp_path / "elsewhere").exists()
