"""Where a restart's teardown goes: the kernel's exit of a rank, and the launcher's own
work before the survivors are signalled.

    python bench/bench_teardown.py [--repeats 7] [--sections exit,close] [--markdown]

Two sections, each side by side with what torchrun's ranks and torchrun do:

* ``exit``: SIGKILL -> the process's pidfd readable (what both launchers wait on before
  a failure is "noticed" or the old workers are "gone") for a child holding the memory
  of one rank of bench_dcp's crash job (``--anon-mib``, its model, AdamW and gradients)
  and that plus the ``--ckpt-ram`` snapshot segment it maps, both generations faulted
  in (``--shm-mib``; the file stays, as the launcher owns it): the kernel unmaps every
  page at exit, in the dying process's own time, which the host's load stretches.
* ``close``: ``close()`` -> its first signal, for ``--workers`` sleeping program
  workers on a host with ``--idle`` more processes (a GPU node runs hundreds): torch's
  ``SubprocessContext`` (torchrun's) vs stalwart's ``ProcessContext``, interleaved.

Prints medians (and min / max) with ``uptime`` before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MIB = 2**20
PAGE = 4096


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _hold(anon_mib: int, shm_path: str | None, shm_mib: int, ready: int) -> None:
    """Child: faults in its memory, says so, then waits to be killed."""
    held: list[Any] = []
    if anon_mib:
        buf = bytearray(anon_mib * MIB)
        for i in range(0, len(buf), PAGE):
            buf[i] = 1
        held.append(buf)
    if shm_path is not None and shm_mib:
        fd = os.open(shm_path, os.O_RDWR)
        seg = mmap.mmap(fd, shm_mib * MIB)
        os.close(fd)
        for i in range(0, len(seg), PAGE):
            seg[i] = 1
        held.append(seg)
    os.write(ready, b"x")
    while True:
        time.sleep(60)


def exit_once(anon_mib: int, shm_mib: int) -> float:
    """Seconds from SIGKILL to the pidfd of a child holding that memory."""
    shm_path = None
    if shm_mib:
        fd, shm_path = tempfile.mkstemp(dir="/dev/shm", prefix="bench-teardown-")
        os.ftruncate(fd, shm_mib * MIB)
        os.close(fd)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            _hold(anon_mib, shm_path, shm_mib, w)
        finally:
            os._exit(1)
    os.close(w)
    try:
        if os.read(r, 1) != b"x":
            raise RuntimeError("the child could not fault in its memory")
        pidfd = os.pidfd_open(pid)
        t = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        select.select([pidfd], [], [])
        took = time.monotonic() - t
        os.close(pidfd)
        return took
    finally:
        os.close(r)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if shm_path is not None:
            os.unlink(shm_path)


@contextlib.contextmanager
def _first_signal(found: list[float]) -> Iterator[None]:
    """Notes when the first kill/killpg is sent (both contexts signal through ``os``)."""
    kill, killpg = os.kill, os.killpg

    def spy(real: Callable[[int, int], None]) -> Callable[[int, int], None]:
        def send(pid: int, sig: int) -> None:
            if not found:
                found.append(time.monotonic())
            real(pid, sig)

        return send

    os.kill, os.killpg = spy(kill), spy(killpg)  # type: ignore[assignment]
    try:
        yield
    finally:
        os.kill, os.killpg = kill, killpg  # type: ignore[assignment]


def close_once(which: str, workers: int, work: Path) -> float:
    """Seconds from close() to its first signal, ``which``: torch or stalwart."""
    args = {lr: ("-c", "exec sleep 300") for lr in range(workers)}
    envs = {lr: {"RANK": str(lr), "LOCAL_RANK": str(lr)} for lr in range(workers)}
    ctx: Any
    if which == "torch":
        from torch.distributed.elastic.multiprocessing import start_processes
        from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs

        ctx = start_processes("bench", "/bin/sh", args, envs, DefaultLogsSpecs(str(work)))
    else:
        from stalwart.launch.files.logs import LogSpec
        from stalwart.launch.workers import processes

        logs = LogSpec(work / "run").make(0, workers, {i: i for i in range(workers)}, "x", 0)
        ctx = processes.start_processes("/bin/sh", args, envs, logs)
    time.sleep(0.3)  # the shells have exec'd sleep
    found: list[float] = []
    with _first_signal(found):
        t = time.monotonic()
        ctx.close(signal.SIGTERM, 5)
    return found[0] - t


@contextlib.contextmanager
def idle_processes(n: int) -> Iterator[None]:
    """*n* sleeping processes that are not ours (their shell exits: init adopts them)."""
    if not n:
        yield
        return
    fd, pidfile = tempfile.mkstemp(prefix="bench-teardown-idle-")
    os.close(fd)
    subprocess.run(
        ["sh", "-c", f'for i in $(seq {n}); do sleep 900 & echo $! >> "{pidfile}"; done'],
        check=True,
    )
    pids = [int(x) for x in Path(pidfile).read_text().split()]
    os.unlink(pidfile)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _row(label: str, xs: list[float], base: float | None) -> str:
    med = statistics.median(xs)
    ratio = f"{med / base:.2f}" if base else "1.00"
    return f"| {label} | {min(xs) * 1e3:.1f} / {med * 1e3:.1f} / {max(xs) * 1e3:.1f} | {ratio} |"


def exit_section(ns: argparse.Namespace) -> None:
    rows = {"torchrun's rank": (ns.anon_mib, 0), "stalwart's rank": (ns.anon_mib, ns.shm_mib)}
    got: dict[str, list[float]] = {k: [] for k in rows}
    before = _uptime()
    for _ in range(ns.repeats):
        for label, (anon, shm) in rows.items():
            got[label].append(exit_once(anon, shm))
    print(
        f"\n### SIGKILL -> pidfd readable: the kernel's exit of a rank "
        f"({ns.repeats} runs each, ms, min / median / max)\n"
    )
    print(f"- load before: `{before}`\n- load after: `{_uptime()}`\n")
    print("| process | ms | ÷ torchrun's rank |\n|---|---|---|")
    base = statistics.median(got["torchrun's rank"])
    for label, (anon, shm) in rows.items():
        what = f"{label}: {anon} MiB anonymous" + (f" + {shm} MiB snapshot segment" if shm else "")
        print(_row(what, got[label], base))


def close_section(ns: argparse.Namespace) -> None:
    before = _uptime()
    got: dict[str, list[float]] = {"torch": [], "stalwart": []}
    with idle_processes(ns.idle), tempfile.TemporaryDirectory() as tmp:
        for rep in range(ns.repeats):
            for which in got:
                got[which].append(close_once(which, ns.workers, Path(tmp) / f"{which}{rep}"))
        procs = len([p for p in os.listdir("/proc") if p.isdigit()])
    print(
        f"\n### close() -> first signal, {ns.workers} workers, {procs} processes on the "
        f"host ({ns.repeats} runs each, ms, min / median / max)\n"
    )
    print(f"- load before: `{before}`\n- load after: `{_uptime()}`\n")
    print("| context | ms | ÷ torch |\n|---|---|---|")
    base = statistics.median(got["torch"])
    print(_row("torch SubprocessContext (torchrun)", got["torch"], base))
    print(_row("stalwart ProcessContext", got["stalwart"], base))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sections", default="exit,close")
    ap.add_argument("--anon-mib", type=int, default=2048)
    ap.add_argument("--shm-mib", type=int, default=2432)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--markdown", action="store_true", help="(the output is markdown)")
    ns = ap.parse_args()
    sections = ns.sections.split(",")
    unknown = set(sections) - {"exit", "close"}
    if unknown or ns.repeats < 1:
        print(f"bench_teardown: bad --sections {ns.sections!r} or --repeats", file=sys.stderr)
        return 2
    if "exit" in sections:
        exit_section(ns)
    if "close" in sections:
        close_section(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
