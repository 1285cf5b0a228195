"""The warm template: imports the heavy modules once, then forks workers on request.

Started by the supervisor as ``python -u -m stalwart.launch.workers.zygote --sock FD --preload
a,b``.  After importing (torch, torch.distributed, torch._dynamo and the user's list) it
reports ``{"ready": true, "rss": ...}`` and serves spawn requests on a ``SOCK_SEQPACKET``
socket: one JSON message with the worker's argv, environment and working directory, and
its stdin/stdout/stderr as file descriptors (``SCM_RIGHTS``), plus optionally a fourth:
the write end of a pipe on which the worker reports the modules the program imported
(learned preload, see ``learned_modules``).  Nothing is unpickled.  A ``{"check": true}``
request with three descriptors forks the node's collective link check instead
(``stalwart.health.linkrun``, torch already imported): the check before a round then
costs no interpreter start and no torch import of its own.

With ``--learned`` the first message on the socket is a JSON list of modules a worker of
this job imported; the template imports them too (at low priority: it is prepared in the
background while the job trains), dropping any that fail.  A module that starts a thread
or initialises CUDA makes that template unusable (it says which), never a worker.  The
usual way to get such a template is a ``{"learn": [...]}`` request with one descriptor,
a socket: the serving template forks the next one (as it forks a worker), which imports
only those modules and then serves on that socket.

Each worker is made by a double fork: the intermediate child forks the worker and exits,
so the worker is re-parented to the launcher (a child subreaper) and the launcher can
wait for it, read its exit status and signal it like any child it spawned itself.  The
worker then puts itself in the state a fresh ``python -u`` would have (own process group,
environment, cwd, standard streams, default signal handlers, fresh random state, the
parent-death signal once the launcher is its parent) and runs the target through
``bootstrap.run_target``, exiting through the interpreter's normal shutdown (a program
that failed: through ``exiting``, without the interpreter's teardown).

Before running the target, while still one thread, a worker forks the seed of its
checkpoint writer (``stalwart.checkpoint.seed``), which never imports the program.

Forking is refused (the launcher falls back to a cold spawn) if this process has more
than one thread or has initialised CUDA: forking after either is unsafe.
"""

from __future__ import annotations

import _thread
import argparse
import fcntl
import gc
import importlib
import json
import os
import resource
import select
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

from stalwart.checkpoint import seed
from stalwart.launch.workers import prewarm

DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel")
# All the link check needs: a check asked for while the template still imports is forked
# as soon as this is in, not after the rest (dynamo alone took as long again, measured).
LINK_CHECK_NEEDS = "torch.distributed"
# stalwart's own checkpointing, for the writer seed each worker forks (seed.py) and for
# the program that imports it: a few tenths of a second per restart otherwise (0.44 s
# from a seed to a ready writer on a loaded machine, measured). Not required: a failure
# only leaves them to be imported when used.
WRITER_PRELOAD = (
    "stalwart.checkpoint.checkpointer",
    "stalwart.checkpoint.resume",
    "stalwart.checkpoint.child",
)
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


def fresh_random_state() -> None:
    """Seeds the global generators from OS entropy, as a new interpreter does: otherwise
    every worker forked from one template draws the same "random" numbers.  Python's
    ``random`` reseeds itself after a fork; torch's CPU generator and numpy's legacy global
    ``RandomState`` do not.  CUDA generators need nothing: the template never creates them
    (it refuses to fork once CUDA is initialised)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()


# Learned preload: a worker reports the modules its program imported once they have
# settled (no new module for SETTLE_S, by then the framework's lazy imports of the first
# steps are in), and again if more come, for LISTEN_S after its start.
SETTLE_S = 1.0
LISTEN_S = 60.0
_CHECK_EVERY_S = 0.25


def report_due(elapsed: float, quiet: float, count: int, reported: int) -> bool:
    """Whether a worker *elapsed* seconds into its program, whose ``sys.modules`` has held
    *count* entries for *quiet* seconds, reports them (it last did at *reported*)."""
    return elapsed >= SETTLE_S and quiet >= SETTLE_S and count > reported


def learned_modules(
    modules: Iterable[tuple[str, str | None]], known: set[str], own_dirs: Iterable[str]
) -> list[str]:
    """Of (name, file) pairs in import order, those a template may import for the next
    workers: new since the fork, loaded from a file, and not the program's own code (its
    script's folder, or the working directory for ``-m``), which a restart must read
    afresh as a cold start would."""
    own = tuple(os.path.join(os.path.abspath(d), "") for d in own_dirs)
    out: list[str] = []
    for name, file in modules:
        if name in known or name in ("__main__", "__mp_main__") or not file:
            continue
        if own and os.path.abspath(file).startswith(own):
            continue
        out.append(name)
    return out


class _Reporter:
    """Writes the program's new modules to the launcher's pipe, from a thread made with
    ``_thread`` rather than ``threading``: the program's ``threading.enumerate()`` and
    ``active_count()`` stay those of a cold process.  (A ``gc`` callback was tried first: a
    torch training loop frees its tensors by reference counting and can go half a minute
    without a collection.)  It ends after LISTEN_S or when the pipe is gone."""

    def __init__(self, fd: int, known: set[str], own_dirs: list[str]) -> None:
        self.fd = fd
        st = os.fstat(fd)
        # The program may close the descriptor and open a file that gets its number:
        # nothing of ours is ever written there.
        self.identity = (st.st_dev, st.st_ino)
        self.known = known
        self.own_dirs = own_dirs
        self.t0 = self.changed = time.monotonic()
        self.count = len(sys.modules)
        self.reported = len(sys.modules)

    def install(self) -> None:
        _thread.start_new_thread(self._run, ())

    def _still_ours(self) -> bool:
        try:
            st = os.fstat(self.fd)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.identity

    def _run(self) -> None:
        try:
            while self.check(time.monotonic()):
                time.sleep(_CHECK_EVERY_S)
        finally:
            if self._still_ours():
                try:
                    os.close(self.fd)
                except OSError:
                    pass

    def check(self, now: float) -> bool:
        """Reports if due; whether to keep watching."""
        count = len(sys.modules)
        if count != self.count:
            self.count, self.changed = count, now
        if report_due(now - self.t0, now - self.changed, count, self.reported):
            pairs = [(n, getattr(m, "__file__", None)) for n, m in list(sys.modules.items())]
            names = learned_modules(pairs, self.known, self.own_dirs)
            self.reported = count
            try:
                if not self._still_ours():
                    return False
                os.write(self.fd, (json.dumps(names) + "\n").encode())
            except OSError:
                return False  # the launcher stopped listening, or the program closed the fd
        return now - self.t0 < LISTEN_S


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.send(json.dumps(obj).encode())


def _become_worker(req: dict[str, Any], fds: list[int], sock: socket.socket) -> list[str]:
    """In the forked worker: take the state of a fresh interpreter; returns the argv."""
    sock.close()
    # Its own session (and so its own process group), as torchrun's workers: a program
    # that checks ``os.getsid`` or opens a terminal sees what it would see there.
    os.setsid()
    learn_fd = _out_of_the_way(fds[3]) if len(fds) > 3 else None
    for target, fd in zip((0, 1, 2), fds[:3], strict=True):
        os.dup2(fd, target)
    for fd in fds[:3]:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in _RESET:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _adopted_by(int(req["launcher_pid"]))
    from stalwart.base import envvars

    fresh_random_state()
    # The template imported torch with one OpenMP thread (any more and it could not fork);
    # the worker gets the count it asked for, or the one a cold start would have had.
    threads = os.environ.get(envvars.OMP_NUM_THREADS) or str(req.get("threads") or "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit():
        torch.set_num_threads(int(threads))
    argv = list(req["argv"])
    # Still one thread and nothing of the program loaded: the moment to fork the seed of
    # this worker's checkpoint writer (torch imported, ready in milliseconds when the
    # program first saves). Before the reporter's thread starts, which would make it unsafe.
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    seed.prefork(fd_floor=learn_fd_floor(soft), close=() if learn_fd is None else (learn_fd,))
    if learn_fd is not None:
        own = (
            req["cwd"] if argv[:1] == ["-m"] else os.path.dirname(os.path.join(req["cwd"], argv[0]))
        )
        _Reporter(learn_fd, set(sys.modules), [own]).install()
    return argv


# Where the learn pipe goes in a worker: above the descriptors programs use by number
# (``dup2(f, 3)``, ``closerange(3, 256)``), where it cannot take one the program expects.
HIGH_FD = 1000


def learn_fd_floor(soft_limit: int) -> int | None:
    """The lowest descriptor the learn pipe may move to under a soft RLIMIT_NOFILE of
    *soft_limit* (negative: unlimited), or None to leave it where it is: HIGH_FD, or half
    the limit where that is lower (the program keeps the room above for its own files),
    never within 3..255."""
    if soft_limit < 0 or soft_limit >= 2 * HIGH_FD:
        return HIGH_FD
    floor = soft_limit // 2
    return floor if floor > 255 else None


def _out_of_the_way(fd: int) -> int:
    """Moves *fd* up to ``learn_fd_floor``, close-on-exec either way: never inherited by
    the program's children."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    floor = learn_fd_floor(soft)
    if floor is None:
        os.set_inheritable(fd, False)
        return fd
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)
    os.close(fd)
    return high


def _adopted_by(launcher: int) -> None:
    """In a process ``_fork_detached`` made: binds its parent-death signal to the launcher."""
    # The intermediate has exited by the time the template answers, but the kernel may
    # still be re-parenting us; the parent-death signal must name the launcher.
    deadline = time.monotonic() + 5.0
    while os.getppid() != launcher and time.monotonic() < deadline:
        time.sleep(0.0005)
    from stalwart.base.procs import pdeathsig_then_check

    pdeathsig_then_check(launcher)


def _fork_detached() -> int | None:
    """Forks through an intermediate that exits at once, so the launcher (a child
    subreaper) adopts the new process and can wait for it like a child of its own.
    Returns 0 in the new process, its pid here, None if a fork failed."""
    r, w = os.pipe()
    mid = os.fork()
    if mid == 0:  # intermediate
        os.close(r)
        try:
            child = os.fork()
        except OSError:
            os._exit(1)
        if child == 0:
            os.close(w)
            return 0
        os.write(w, str(child).encode())
        os._exit(0)
    os.close(w)
    raw = os.read(r, 32)
    os.close(r)
    os.waitpid(mid, 0)  # once reaped, the new process belongs to the launcher
    return int(raw) if raw else None


@dataclass
class NextTemplate:
    """A request to become the template that serves the next start: the socket to
    serve it on, and the modules a worker of this job imported (learned preload)."""

    sock: socket.socket
    learned: list[str]
    launcher: int


@dataclass
class LinkCheckChild:
    """This process was forked to be the node's collective link check."""


def _become_link_check(fds: list[int], sock: socket.socket, launcher: int) -> LinkCheckChild:
    """In the forked check: the launcher's pipes as its standard streams, a session of
    its own (killed as a whole at its bound), default signal handlers and the launcher's
    death as its own. None of a worker's state: no program environment, no checkpoint
    writer seed, no module reporter."""
    sock.close()
    os.setsid()
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in _RESET:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _adopted_by(launcher)
    from stalwart.launch.workers.bootstrap import set_title

    # What ``ps`` shows for the check started cold.
    set_title([sys.executable, "-m", "stalwart.health.linkrun"])
    return LinkCheckChild()


def early_link_check(sock: socket.socket) -> LinkCheckChild | None:
    """Between two imports: forks the link check if the launcher asked for one already
    (only a check is asked for before the template says it is ready); a
    ``LinkCheckChild`` in the forked check, None here (importing goes on)."""
    if fork_blocker() is not None or not select.select([sock], [], [], 0)[0]:
        return None  # a blocked fork: the request waits, and is refused, in serve()
    try:
        msg, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MSG, 4)
    except OSError:
        return None
    try:
        req = json.loads(msg) if msg else {}
    except ValueError:
        req = {}
    if not req.get("check") or len(fds) != 3:
        if msg:
            _send(sock, {"ok": False, "error": "not a link check request"})
        for fd in fds:
            os.close(fd)
        return None
    pid = _fork_detached()
    if pid == 0:
        return _become_link_check(fds, sock, int(req["launcher_pid"]))
    for fd in fds:
        os.close(fd)
    _send(sock, {"ok": True, "pid": pid} if pid else {"ok": False, "error": "fork failed"})
    return None


def _run_link_check() -> NoReturn:
    from stalwart.health import linkrun

    code = linkrun.main([])
    sys.stdout.flush()
    # Not the interpreter's teardown: the template's atexit hooks and frozen objects are
    # none of the check's business.
    os._exit(code)


def serve(sock: socket.socket) -> list[str] | NextTemplate | LinkCheckChild | None:
    """Answers requests until the launcher closes the socket.  Returns the argv of the
    target in a forked worker (which then runs it), a ``NextTemplate`` in a forked
    template, a ``LinkCheckChild`` in a forked link check, None in this template at
    EOF."""
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MSG, 4)
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
        learn = req.get("learn")
        check = bool(req.get("check"))
        blocker = fork_blocker()
        expected = (1,) if learn is not None else (3,) if check else (3, 4)
        if blocker is not None or len(fds) not in expected:
            _send(sock, {"ok": False, "error": blocker or f"expected {expected} descriptors"})
            for fd in fds:
                os.close(fd)
            continue
        pid = _fork_detached()
        if pid == 0:
            if learn is not None:
                sock.close()
                learned = [str(m) for m in learn]
                return NextTemplate(socket.socket(fileno=fds[0]), learned, req["launcher_pid"])
            if check:
                return _become_link_check(fds, sock, int(req["launcher_pid"]))
            return _become_worker(req, fds, sock)
        for fd in fds:
            os.close(fd)
        if pid is not None:
            _send(sock, {"ok": True, "pid": pid})
        else:
            _send(sock, {"ok": False, "error": "fork failed"})


def _lower_priority() -> Callable[[], None]:
    """Lowers this process's CPU priority for a background import; returns what restores
    it before forking (workers inherit it).  ``nice 19`` when this process may raise its
    priority back (root, or RLIMIT_NICE allows it; probed in a throwaway child, as
    lowering cannot be undone otherwise), else SCHED_BATCH, which anyone may leave."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    probe = os.fork()
    if probe == 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 19)
            os.setpriority(os.PRIO_PROCESS, 0, before)
        except OSError:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(probe, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        os.setpriority(os.PRIO_PROCESS, 0, 19)
        return lambda: os.setpriority(os.PRIO_PROCESS, 0, before)
    policy = os.sched_getscheduler(0)
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:
        return lambda: None
    return lambda: os.sched_setscheduler(0, policy, os.sched_param(0))


def _import_learned(names: list[str]) -> tuple[list[str], list[str], str | None]:
    """Imports what a worker of this job imported: (imported, dropped with the reason,
    why this template must not fork or None).  Checked after every module, so the
    message names the one that started a thread or initialised CUDA."""
    done: list[str] = []
    dropped: list[str] = []
    for name in names:
        if name in sys.modules:
            done.append(name)
            continue
        try:
            importlib.import_module(name)
        except BaseException as exc:  # a learned module must never break a restart
            dropped.append(f"{name} ({type(exc).__name__}: {exc})")
            continue
        blocker = fork_blocker()
        if blocker is not None:
            return done, dropped, f"learned module {name}: {blocker}"
        done.append(name)
    return done, dropped, None


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m stalwart.launch.workers.zygote")
    ap.add_argument("--sock", type=int, required=True)
    ap.add_argument("--preload", default="")
    ap.add_argument("--learned", action="store_true")
    ap.add_argument("--title-room", default="")
    ns = ap.parse_args()
    # Imported here rather than after the fork: what workers report as their program's
    # modules is what they have beyond the template's.
    from stalwart.launch.workers.bootstrap import set_title

    set_title([sys.executable, *(a for a in sys.orig_argv[1:] if not a.startswith("--title-room"))])
    sock = socket.socket(fileno=ns.sock)
    learned: list[str] = []
    if ns.learned:
        learned = [str(m) for m in json.loads(sock.recv(_MAX_MSG) or b"[]")]
    restore = _lower_priority() if ns.learned else (lambda: None)
    t0 = time.monotonic()
    modules = list(DEFAULT_PRELOAD) + [m for m in ns.preload.split(",") if m]
    checks_now = False  # the link check's needs are in: a check asked for is forked
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # any import failure means: start workers cold
            _send(sock, {"ready": False, "error": f"--preload {name}: {type(exc).__name__}: {exc}"})
            return
        checks_now = checks_now or name == LINK_CHECK_NEEDS
        if checks_now and isinstance(early_link_check(sock), LinkCheckChild):
            _run_link_check()
    for name in WRITER_PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:
            print(f"stalwart template: {name} not preloaded: {exc}", file=sys.stderr)
    if not _say_ready(sock, modules, learned, restore, t0):
        return
    result = serve(sock)
    while isinstance(result, NextTemplate):
        # Forked from the serving template, torch and the rest already imported: only
        # the learned modules are left to import, in the background.
        _adopted_by(result.launcher)
        restore = _lower_priority()
        if not _say_ready(result.sock, modules, result.learned, restore, time.monotonic()):
            return
        result = serve(result.sock)
    if result is None:
        return
    if isinstance(result, LinkCheckChild):
        _run_link_check()
    from stalwart.launch.workers.bootstrap import observe, run_target

    observe()
    run_target(result)


def _say_ready(
    sock: socket.socket,
    modules: list[str],
    learned: list[str],
    restore: Callable[[], None],
    t0: float,
) -> bool:
    """Imports the learned modules and tells the launcher whether this template can
    serve (and if not, why)."""
    blocker = fork_blocker()
    done, dropped, learn_blocker = _import_learned(learned)
    warmed: list[str] = []
    if blocker is None and learn_blocker is None:
        # Still at low priority where it is a learned template: the job is training.
        warmed, failed = prewarm.run(prewarm.due(sys.modules), sys.modules)
        dropped += failed
        if (why := fork_blocker()) is not None:
            learn_blocker = f"prewarm {', '.join(warmed)}: {why}"
    restore()
    blocker = blocker or learn_blocker
    if blocker is not None:
        _send(sock, {"ready": False, "error": blocker, "dropped": dropped})
        return False
    # Everything imported so far lives as long as any worker does.  Frozen, the workers'
    # collections never walk it: a full collection over torch and a framework touches
    # every object's header, which in a forked worker also copies each page, and the
    # interpreter's shutdown runs several of them.  Measured in a worker forked from a
    # template with Lightning: 1.8 s of CPU from the end of the script to its exit,
    # 0.34 s frozen (the 6 to 12 s seen on a loaded machine).  A cold worker pays the
    # same shutdown; what freezing changes is stated in docs/launcher.md.
    gc.freeze()
    _send(
        sock,
        {
            "ready": True,
            "rss": rss_bytes(),
            "modules": modules,
            "learned": done,
            "dropped": dropped,
            "prewarmed": warmed,
            "import_s": time.monotonic() - t0,
        },
    )
    return True


if __name__ == "__main__":
    main()
