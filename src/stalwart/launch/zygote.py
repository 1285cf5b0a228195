"""The warm template: imports the heavy modules once, then forks workers on request.

Started by the supervisor as ``python -u -m stalwart.launch.zygote --sock FD --preload
a,b``.  After importing (torch, torch.distributed, torch._dynamo and the user's list) it
reports ``{"ready": true, "rss": ...}`` and serves spawn requests on a ``SOCK_SEQPACKET``
socket: one JSON message with the worker's argv, environment and working directory, and
its stdin/stdout/stderr as file descriptors (``SCM_RIGHTS``).  Nothing is unpickled.

Each worker is made by a double fork: the intermediate child forks the worker and exits,
so the worker is re-parented to the launcher (a child subreaper) and the launcher can
wait for it, read its exit status and signal it like any child it spawned itself.  The
worker then puts itself in the state a fresh ``python -u`` would have (own process group,
environment, cwd, standard streams, default signal handlers, fresh random state, the
parent-death signal once the launcher is its parent) and runs the target through
``bootstrap.run_target``, exiting through the interpreter's normal shutdown.

Forking is refused (the launcher falls back to a cold spawn) if this process has more
than one thread or has initialised CUDA: forking after either is unsafe.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import signal
import socket
import sys
import time
from typing import Any

DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel")
_MAX_MSG = 1 << 20
_RESET = (
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCHLD,
    signal.SIGALRM,
)


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def fork_blocker() -> str | None:
    """Why forking now would be unsafe, or None."""
    if thread_count() != 1:
        return (
            f"the template has {thread_count()} threads after its imports (forking would be "
            "unsafe); a BLAS library started them: set OMP_NUM_THREADS=1 to keep warm starts"
        )
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the template has initialised CUDA"
    return None


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.send(json.dumps(obj).encode())


def _become_worker(req: dict[str, Any], fds: list[int], sock: socket.socket) -> list[str]:
    """In the forked worker: take the state of a fresh interpreter; returns the argv."""
    sock.close()
    os.setpgid(0, 0)
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in _RESET:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    launcher = int(req["launcher_pid"])
    # The intermediate has exited by the time the template answers, but the kernel may
    # still be re-parenting us; the parent-death signal must name the launcher.
    deadline = time.monotonic() + 5.0
    while os.getppid() != launcher and time.monotonic() < deadline:
        time.sleep(0.0005)
    from stalwart.launch.posix import pdeathsig_then_check

    pdeathsig_then_check(launcher)
    random.seed()
    # The template imported torch with one OpenMP thread (any more and it could not fork);
    # the worker gets the count it asked for, or the one a cold start would have had.
    threads = os.environ.get("OMP_NUM_THREADS") or str(req.get("threads") or "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit():
        torch.set_num_threads(int(threads))
    return list(req["argv"])


def serve(sock: socket.socket) -> list[str] | None:
    """Answers spawn requests until the launcher closes the socket.  Returns the argv of
    the target in a forked worker (which then runs it); None in the template at EOF."""
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MSG, 3)
        except (ConnectionResetError, OSError):
            return None
        if not msg:
            return None
        try:
            req = json.loads(msg)
        except ValueError:
            _send(sock, {"ok": False, "error": "malformed request"})
            for fd in fds:
                os.close(fd)
            continue
        blocker = fork_blocker()
        if blocker is not None or len(fds) != 3:
            _send(sock, {"ok": False, "error": blocker or "expected 3 file descriptors"})
            for fd in fds:
                os.close(fd)
            continue
        r, w = os.pipe()
        mid = os.fork()
        if mid == 0:  # intermediate
            os.close(r)
            try:
                worker = os.fork()
            except OSError:
                os._exit(1)
            if worker == 0:
                os.close(w)
                return _become_worker(req, fds, sock)
            os.write(w, str(worker).encode())
            os._exit(0)
        os.close(w)
        for fd in fds:
            os.close(fd)
        raw = os.read(r, 32)
        os.close(r)
        os.waitpid(mid, 0)  # once reaped, the worker belongs to the launcher
        if raw:
            _send(sock, {"ok": True, "pid": int(raw)})
        else:
            _send(sock, {"ok": False, "error": "fork failed"})


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m stalwart.launch.zygote")
    ap.add_argument("--sock", type=int, required=True)
    ap.add_argument("--preload", default="")
    ns = ap.parse_args()
    sock = socket.socket(fileno=ns.sock)
    t0 = time.monotonic()
    modules = list(DEFAULT_PRELOAD) + [m for m in ns.preload.split(",") if m]
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # any import failure means: start workers cold
            _send(sock, {"ready": False, "error": f"--preload {name}: {type(exc).__name__}: {exc}"})
            return
    blocker = fork_blocker()
    if blocker is not None:
        _send(sock, {"ready": False, "error": blocker})
        return
    _send(
        sock,
        {"ready": True, "rss": rss_bytes(), "modules": modules, "import_s": time.monotonic() - t0},
    )
    argv = serve(sock)
    if argv is None:
        return
    from stalwart.launch.bootstrap import observe, run_target

    observe()
    run_target(argv)


if __name__ == "__main__":
    main()
