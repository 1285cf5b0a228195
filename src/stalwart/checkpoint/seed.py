"""How the writer's process comes to exist, without ever importing the user's ``__main__``.

multiprocessing's ``spawn`` re-imports the main module in the child: a training script
without an ``if __name__ == "__main__":`` guard would run its whole body a second time
there, beside the real rank.  So a writer child starts one of three ways
(:func:`choose_start`, a pure decision):

* ``PREFORKED``: a warm worker (forked from the launcher's template, torch already
  imported) forks a *seed* before the program runs (:func:`prefork`).  The seed waits,
  single-threaded and with nothing of the program in it, until the first writer of the
  process takes it: that writer is ready in milliseconds instead of a fresh interpreter's
  seconds of importing torch.
* ``FRESH``: a new interpreter that runs only this module's :func:`serve_fd` (cold
  workers, plain torchrun, a second writer in one worker).
* ``SPAWN``: multiprocessing's ``spawn``, which does import ``__main__``.  Used only
  when the user's own init function or writer lives in ``__main__`` (torch's
  ``CheckpointProcess`` API): the child cannot find them otherwise.  Such a script needs
  the guard, as it does under torch.

Whichever way, the parent then hands the child the same things over a private socket
pair: the staging buffer's descriptor (``SCM_RIGHTS``), what a spawned child would have
inherited (``sys.path``, working directory, environment: JSON), and the pickled writer
arguments.  The socket is the parent's own, so unpickling what comes through it trusts
no one else.  Imports only the standard library at import time: the warm template
imports it before forking workers.
"""

from __future__ import annotations

import enum
import fcntl
import json
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# The surroundings record is small; anything larger is not ours.
_MAX_SURROUNDINGS = 16 << 20
_MAIN_NAMES = ("__main__", "__mp_main__")
_FRESH_CODE = (
    "import sys; from stalwart.checkpoint.seed import serve_fd; serve_fd(int(sys.argv[1]))"
)


class StartMethod(enum.Enum):
    PREFORKED = "preforked"
    FRESH = "fresh"
    SPAWN = "spawn"


def choose_start(*, needs_main: bool, seed_ready: bool) -> StartMethod:
    """How to start a writer whose arguments do (or do not) refer to ``__main__``, when a
    preforked seed is (or is not) waiting in this process."""
    if needs_main:
        return StartMethod.SPAWN
    return StartMethod.PREFORKED if seed_ready else StartMethod.FRESH


class _MainFinder(pickle.Pickler):
    """Pickles like ``pickle.dumps`` and notes whether anything refers to ``__main__``."""

    uses_main = False

    def reducer_override(self, obj: Any) -> Any:
        where = obj if isinstance(obj, type) or callable(obj) else type(obj)
        if getattr(where, "__module__", None) in _MAIN_NAMES:
            self.uses_main = True
        return NotImplemented


def pickle_args(args: tuple[Any, ...]) -> tuple[bytes, bool]:
    """The pickled writer arguments, and whether unpickling them needs ``__main__``."""
    import io

    buf = io.BytesIO()
    finder = _MainFinder(buf, protocol=pickle.HIGHEST_PROTOCOL)
    finder.dump(args)
    return buf.getvalue(), finder.uses_main


@dataclass(frozen=True)
class Surroundings:
    """What a child spawned now would inherit; applied before the arguments are unpickled."""

    sys_path: list[str]
    cwd: str
    env: dict[str, str]

    @classmethod
    def now(cls) -> Surroundings:
        return cls(list(sys.path), os.getcwd(), dict(os.environ))

    def encode(self) -> bytes:
        return json.dumps({"sys_path": self.sys_path, "cwd": self.cwd, "env": self.env}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Surroundings:
        obj = json.loads(raw)
        if not isinstance(obj, dict):
            raise ValueError("writer surroundings: expected a JSON object")
        path, cwd, env = obj.get("sys_path"), obj.get("cwd"), obj.get("env")
        if not (
            isinstance(path, list)
            and all(isinstance(p, str) for p in path)
            and isinstance(cwd, str)
            and isinstance(env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            raise ValueError("writer surroundings: sys_path, cwd or env has the wrong type")
        return cls(path, cwd, env)

    def apply(self) -> None:
        sys.path[:] = self.sys_path
        os.environ.clear()
        os.environ.update(self.env)
        try:
            os.chdir(self.cwd)
        except OSError as exc:
            logger.debug("writer keeps its working directory: %s", exc)


class ChildProcess(Protocol):
    """The parts of ``multiprocessing.Process`` the writer's parent uses."""

    @property
    def pid(self) -> int | None: ...
    @property
    def sentinel(self) -> int: ...
    @property
    def exitcode(self) -> int | None: ...
    def is_alive(self) -> bool: ...
    def kill(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...


class _PidChild:
    """A direct child known by its pid (a forked seed) or by its ``Popen`` (a fresh one)."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        self._pid = pid
        self._popen = popen
        self._code: int | None = None
        # Readable once the child exits: what ``multiprocessing.connection.wait`` watches.
        self._pidfd = os.pidfd_open(pid)

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def sentinel(self) -> int:
        return self._pidfd

    @property
    def exitcode(self) -> int | None:
        self._poll(block=False)
        return self._code

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        if self._code is None:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def join(self, timeout: float | None = None) -> None:
        if self._code is not None:
            return
        if timeout is not None:
            from multiprocessing.connection import wait

            if not wait([self._pidfd], timeout):
                return
        self._poll(block=True)

    def _poll(self, *, block: bool) -> None:
        if self._code is not None:
            return
        if self._popen is not None:
            code = self._popen.wait() if block else self._popen.poll()
        else:
            try:
                pid, status = os.waitpid(self._pid, 0 if block else os.WNOHANG)
            except ChildProcessError:
                pid, status = self._pid, 0  # reaped by someone else: its code is lost
            code = os.waitstatus_to_exitcode(status) if pid else None
        if code is not None:
            self._code = code
            os.close(self._pidfd)
            self._pidfd = -1


# -- the preforked seed ------------------------------------------------------------------


@dataclass
class _Seed:
    pid: int
    sock: socket.socket
    owner: int  # the process that forked it; a fork of that process must not use it
    # The socket's identity: a program may close its descriptor and open a file that
    # gets the same number, which must then be neither used nor closed by us.
    identity: tuple[int, int]

    def still_ours(self) -> bool:
        try:
            st = os.fstat(self.sock.fileno())
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.identity


_seed_lock = threading.Lock()
_seed: _Seed | None = None


def prefork(*, fd_floor: int | None, close: tuple[int, ...] = ()) -> int | None:
    """Forks a writer seed from this (single-threaded, not yet running the program)
    process; returns its pid, or None if the fork failed.  The parent's end of the socket
    moves to ``fd_floor`` or above, close-on-exec, out of the program's way; ``close``:
    descriptors the seed must not keep open."""
    global _seed
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if fd_floor is not None:
        high = fcntl.fcntl(mine.fileno(), fcntl.F_DUPFD_CLOEXEC, fd_floor)
        mine.close()
        mine = socket.socket(fileno=high)
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError as exc:
        logger.debug("no writer seed: %s", exc)
        mine.close()
        theirs.close()
        return None
    if pid == 0:  # the seed: never returns into the caller, which would run the program
        code = 0
        try:
            mine.close()
            for fd in close:
                try:
                    os.close(fd)
                except OSError:
                    pass
            from stalwart.base.procs import pdeathsig_then_check

            # Idle seeds go with their worker, however it ends.
            pdeathsig_then_check(parent)
            serve_fd(theirs.detach(), seeded=True)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    theirs.close()
    st = os.fstat(mine.fileno())
    with _seed_lock:
        _seed = _Seed(pid, mine, parent, (st.st_dev, st.st_ino))
    return pid


def _take_seed() -> _Seed | None:
    global _seed
    with _seed_lock:
        seed, _seed = _seed, None
    if seed is None:
        return None
    if seed.owner != os.getpid() or not seed.still_ours():
        # Inherited through a fork of the worker (not our child), or the program closed
        # the descriptor: forget it without touching whatever the number is now.
        seed.sock.detach()
        return None
    return seed


def seed_waiting() -> bool:
    """Whether this process has an unused preforked seed."""
    seed = _seed
    return seed is not None and seed.owner == os.getpid()


# -- the parent's side -------------------------------------------------------------------


class _InheritedFd:
    """Pickles as a duplicate of ``fd`` that the spawned child inherits."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        # DupFd must be created while the spawn is pickling the child's args:
        # that is when it can register the fd to be passed to the new process.
        return (_detach_fd, (reduction.DupFd(self.fd),))


def _detach_fd(dup: Any) -> int:
    return int(dup.detach())


def _spawned_main(fd: int) -> None:
    serve_fd(fd)


def _start_fresh() -> tuple[ChildProcess, socket.socket]:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = dict(os.environ)
    # The new interpreter must find stalwart however this one did.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    try:
        popen = subprocess.Popen(
            [sys.executable, "-c", _FRESH_CODE, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
    finally:
        theirs.close()
    return _PidChild(popen.pid, popen), mine


def _start_spawned() -> tuple[ChildProcess, socket.socket]:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(
        target=_spawned_main,
        args=(_InheritedFd(theirs.fileno()),),
        name="stalwart-ckpt-writer",
        daemon=True,
    )
    try:
        proc.start()
    finally:
        theirs.close()
    return proc, mine


def start(args: tuple[Any, ...], buffer_fd: int) -> tuple[StartMethod, ChildProcess, Connection]:
    """Starts a writer child for ``writer_main(conn, buffer_fd, *args)``; returns how,
    its handle, and the parent's end of the connection (the child answers a ping once
    its writer is ready, or sends its start-up failure)."""
    payload, needs_main = pickle_args(args)
    seed = None if needs_main else _take_seed()
    method = choose_start(needs_main=needs_main, seed_ready=seed is not None)
    while True:
        if seed is not None:
            proc: ChildProcess = _PidChild(seed.pid)
            sock = seed.sock
        elif method is StartMethod.SPAWN:
            proc, sock = _start_spawned()
        else:
            proc, sock = _start_fresh()
        try:
            socket.send_fds(sock, [b"F"], [buffer_fd])
            conn = Connection(sock.detach())
            conn.send_bytes(Surroundings.now().encode())
            conn.send_bytes(payload)
        except OSError as exc:
            sock.close()
            proc.kill()
            proc.join(5.0)
            if seed is None:
                raise
            # The seed died while it waited (killed by someone): start from cold instead.
            logger.debug("writer seed pid %s unusable (%s); starting a fresh one", seed.pid, exc)
            seed, method = None, StartMethod.FRESH
            continue
        return method, proc, conn


# -- the child's side --------------------------------------------------------------------


def serve_fd(fd: int, *, seeded: bool = False) -> None:
    """In the writer child: take the buffer, the surroundings and the arguments from the
    parent on socket ``fd``, then serve as the writer until told to exit."""
    sock = socket.socket(fileno=fd)
    try:
        _msg, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
    except OSError:
        return
    if not fds:
        return  # the parent went away (or never needed a writer)
    if seeded:
        from stalwart.base.procs import set_parent_death_signal

        # Now a writer: it outlives a crashed parent only to finish the write in hand
        # and then reads EOF, as a spawned writer does.
        set_parent_death_signal(0)
    conn = Connection(sock.detach())
    from .child import report_start_failure, writer_main

    try:
        Surroundings.decode(conn.recv_bytes(_MAX_SURROUNDINGS)).apply()
        args = pickle.loads(conn.recv_bytes())
    except BaseException as exc:
        report_start_failure(conn, exc)
        return
    writer_main(conn, fds[0], *args)
