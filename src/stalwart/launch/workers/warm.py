"""The launcher's side of warm starts: owns the template process and asks it for workers.

The template (``zygote.py``) is started as soon as the supervisor starts, so its imports
overlap the rendezvous; a worker start waits for it only as long as it is still
importing.  If the template cannot be used (a preload fails, it is unsafe to fork, it
died and cannot be restarted) ``spawn`` returns None and the caller starts the worker
cold; the reason is logged once.

Learned preload: the first worker of each start (local rank 0) reports on a pipe the
modules its program imported.  When they are not all in the template, a second template
that also imports them is prepared in the background at low priority and replaces the
first once ready, so later restarts skip the program's framework import.  If it cannot
be used, the first one stays and learning stops for the run (one warning).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from stalwart.base import envvars, procs
from stalwart.base.events import Event
from stalwart.launch.files.runfiles import APPEND_FLAGS

logger = logging.getLogger(__name__)

EventSink = Callable[..., Any]

# Each learned template imports torch and the framework again (seconds of one core, at low
# priority); a program that keeps importing new modules gets no more than this many.
MAX_REBUILDS = 3


class ForkedProcess:
    """A worker the template forked and the kernel re-parented to us: waited on with
    ``waitpid`` like a child we spawned, with ``Popen``'s ``returncode`` convention."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:
                    # Not (or no longer) our child: treat a vanished process as killed.
                    if not procs.exists(self.pid):
                        self.returncode = -int(signal.SIGKILL)
                    return self.returncode
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def kill(self) -> None:
        if self.poll() is not None:
            return  # reaped: the pid may be another process's by now
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        # Only ever called on a process that exited or was SIGKILLed: no deadline.
        while (code := self.poll()) is None:
            time.sleep(0.005)
        return code


# The first template is our child; one forked from a template with learned modules was
# re-parented to us.
Template = subprocess.Popen[bytes] | ForkedProcess


class WarmPool:
    """One template process per node; forks workers that start with torch imported."""

    def __init__(
        self,
        preload: list[str],
        env: dict[str, str],
        emit: EventSink,
        ready_timeout: float = 120.0,
        log_path: str = os.devnull,
        title_room: int = 0,
    ) -> None:
        self.preload = preload
        # Workers take their title in the template's command line (see bootstrap.set_title).
        self.title_room = title_room
        self.log_path = log_path
        self.env = env
        self.emit = emit
        self.ready_timeout = ready_timeout
        self.disabled_reason: str | None = None
        self._proc: Template | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        # Reentrant: ``paused()`` holds it around a scan that asks ``owned_pids()``.
        self._lock = threading.RLock()
        self._modules: set[str] = set()  # what the serving template imported
        self._learned: list[str] = []  # learned modules, in import order
        self._next: tuple[Template, socket.socket] | None = None
        self._learning_off = False
        # Set once the launcher's teardown began: from then on no template is forked or
        # started, and nothing is emitted.
        self._closing = False
        self._rebuilds = 0
        # Templates with learned modules are started from one thread that lives as long as
        # this pool: a child's parent-death signal fires when the thread that forked it
        # ends, and the reader threads end with each worker.
        self._learn_queue: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()
        self._learner: threading.Thread | None = None

    # -- the template's life -----------------------------------------------------------
    def start(self) -> None:
        """Starts the template without waiting for its imports."""
        if self.disabled_reason is not None:
            return
        self._proc, self._sock = self._launch(self._learned)
        self._ready = False
        self.emit(Event.TEMPLATE_START, template_pid=self._proc.pid, preload=self.preload)

    def _launch(self, learned: list[str]) -> tuple[subprocess.Popen[bytes], socket.socket]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        # Import-time chatter of the template goes to its own log, not the job's console;
        # why it is unusable reaches the launcher as one message on the socket.
        log = os.open(self.log_path, APPEND_FLAGS, 0o644)
        argv = [
            sys.executable,
            "-u",
            "-m",
            "stalwart.launch.workers.zygote",
            "--sock",
            str(theirs.fileno()),
            "--preload",
            ",".join(self.preload),
        ]
        if learned:
            argv.append("--learned")
        if self.title_room:
            argv.append("--title-room=" + "." * self.title_room)
        proc = subprocess.Popen(
            argv,
            pass_fds=[theirs.fileno()],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # terminal signals are the launcher's to forward
            preexec_fn=lambda: procs.pdeathsig_then_check(parent),
        )
        os.close(log)
        theirs.close()
        if learned:
            # A list, not an argument: thousands of names can exceed one argument's limit.
            ours.send(json.dumps(learned).encode())
        return proc, ours

    def _await_ready(self) -> bool:
        if self._ready:
            return True
        msg = self._next_message()
        return msg is not None and self._on_ready(msg)

    def _next_message(self) -> bytes | None:
        """The template's next message (b"": it exited); None: it gave none in time, and
        is given up on."""
        assert self._sock is not None and self._proc is not None
        self._sock.settimeout(self.ready_timeout)
        try:
            return self._sock.recv(1 << 16)
        except TimeoutError:
            self._give_up(f"the template did not finish importing in {self.ready_timeout:g}s")
        except OSError as err:
            self._give_up(f"the template is unreachable ({err})")
        finally:
            if self._sock is not None:
                self._sock.settimeout(None)
        return None

    def _on_ready(self, msg: bytes) -> bool:
        """Takes the template's word that it finished importing (or why it cannot serve)."""
        assert self._proc is not None
        if not msg:
            return self._give_up(f"the template exited (code {self._proc.wait()})")
        info = json.loads(msg)
        if not info.get("ready"):
            return self._give_up(str(info.get("error", "the template is not usable")))
        self._ready = True
        self._modules = set(info.get("modules") or []) | set(info.get("learned") or [])
        self.emit(
            Event.TEMPLATE_READY,
            template_pid=self._proc.pid,
            rss_bytes=info.get("rss"),
            import_s=info.get("import_s"),
            modules=info.get("modules"),
            prewarmed=info.get("prewarmed"),
        )
        return True

    def _give_up(self, reason: str) -> bool:
        self.disabled_reason = reason
        logger.warning("warm start disabled, starting workers cold: %s", reason)
        self.emit(Event.TEMPLATE_UNUSABLE, reason=reason)
        self._shutdown()
        return False

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ensure(self) -> bool:
        """True when a usable template is running; restarts one that died."""
        with self._lock:
            if self.disabled_reason is not None or self._closing:
                return False
            if self._proc is not None and not self._alive():
                code = self._proc.returncode
                self.emit(Event.TEMPLATE_DIED, template_pid=self._proc.pid, exitcode=code)
                logger.warning("warm template died (exit %s); starting a new one", code)
                self._shutdown()
                self.start()
            if self._proc is None:
                self.start()
            return self._await_ready()

    # -- learned preload ---------------------------------------------------------------
    def _listen(self, fd: int) -> None:
        """Reads a worker's reports of its program's modules until it exits."""
        with os.fdopen(fd, "rb") as pipe:
            for line in pipe:
                try:
                    names = [str(n) for n in json.loads(line)]
                except (ValueError, TypeError):
                    continue
                self._learn(names)

    def _learn(self, names: list[str]) -> None:
        with self._lock:
            if self._learning_off or self._closing:
                return
            if self._learner is None:
                self._learner = threading.Thread(
                    target=self._learn_loop, name="stalwart-learn", daemon=True
                )
                self._learner.start()
        self._learn_queue.put(names)

    def _learn_loop(self) -> None:
        while (names := self._learn_queue.get()) is not None:
            with self._lock:
                if (
                    self._learning_off
                    or self._closing
                    or self.disabled_reason
                    or self._rebuilds >= MAX_REBUILDS
                ):
                    continue
                known = self._modules | set(self._learned)
                new = [n for n in names if n not in known]
                if not new:
                    continue
                learned = self._learned + new
                try:
                    proc, sock = self._fork_next(learned) or self._launch(learned)
                except OSError as err:
                    self._learning_off = True
                    logger.warning("could not start a template with learned modules: %s", err)
                    continue
                self._next = (proc, sock)
                self._rebuilds += 1
                # Under the lock: once close() has begun, no event of ours follows.
                self.emit(
                    Event.TEMPLATE_LEARN,
                    template_pid=proc.pid,
                    learned=len(learned),
                    new=new[:20],
                    forked=isinstance(proc, ForkedProcess),
                )
            self._adopt(proc, sock)

    def _fork_next(self, learned: list[str]) -> tuple[ForkedProcess, socket.socket] | None:
        """Asks the serving template to fork the next one, which then imports only the
        learned modules (torch is in already: seconds sooner than a new interpreter).
        None when it cannot; the caller then starts one from scratch.  Holds the lock."""
        if self._sock is None or not self._ready:
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        req = {"learn": learned, "launcher_pid": os.getpid()}
        try:
            socket.send_fds(self._sock, [json.dumps(req).encode()], [theirs.fileno()])
            reply = self._sock.recv(1 << 16)
        except OSError as err:
            reply = json.dumps({"ok": False, "error": str(err)}).encode()
        finally:
            theirs.close()
        ans: dict[str, Any] = json.loads(reply) if reply else {"ok": False, "error": "it exited"}
        if not ans.get("ok"):
            ours.close()
            logger.debug("the template could not fork the next one: %s", ans.get("error"))
            return None
        return ForkedProcess(int(ans["pid"])), ours

    def _adopt(self, proc: Template, sock: socket.socket) -> None:
        """Waits for the learned template; it replaces the serving one once ready."""
        try:
            sock.settimeout(self.ready_timeout)
            msg = sock.recv(1 << 20)
            sock.settimeout(None)
        except OSError as err:
            # Also when close() shut this socket while the template was importing.
            msg = json.dumps({"ready": False, "error": f"unreachable ({err})"}).encode()
        info: dict[str, Any] = json.loads(msg) if msg else {"ready": False, "error": "it exited"}
        dropped = info.get("dropped") or []
        if dropped:
            logger.warning(
                "learned preload: %d module(s) the program imported do not import on their "
                "own and stay out of the template: %s",
                len(dropped),
                "; ".join(dropped[:5]) + (" ..." if len(dropped) > 5 else ""),
            )
        # All of it under the lock, so that close() finds either the old template serving
        # (and stops it) or the new one serving with the old one already stopped: never
        # a template that another thread is still about to stop, or an event after it.
        with self._lock:
            self._next = None
            if self._closing:
                _stop(proc, sock)
                return
            usable = info.get("ready") and self.disabled_reason is None and self._sock is not None
            if not usable:
                self._learning_off = True
                _stop(proc, sock)
                logger.warning(
                    "learned preload off for this run: the template with the modules the "
                    "program imported is not usable (%s)",
                    info.get("error", "closed"),
                )
                self.emit(Event.TEMPLATE_LEARN_FAILED, reason=str(info.get("error", "closed")))
                return
            old = (self._proc, self._sock)
            self._proc, self._sock, self._ready = proc, sock, True
            self._learned = list(info.get("learned") or [])
            self._modules = set(info.get("modules") or []) | set(self._learned)
            self.emit(
                Event.TEMPLATE_READY,
                template_pid=proc.pid,
                rss_bytes=info.get("rss"),
                import_s=info.get("import_s"),
                modules=info.get("modules"),
                learned=info.get("learned"),
                dropped=info.get("dropped"),
                prewarmed=info.get("prewarmed"),
            )
            _stop(old[0], old[1])

    # -- workers -----------------------------------------------------------------------
    def spawn(
        self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int], learn: bool = False
    ) -> int | None:
        """Forks a worker that runs ``argv`` (``[-m] TARGET ARGS``); its pid, or None if
        the caller must start it cold.  With *learn*, the worker reports the modules its
        program imports, for the template that serves the next start."""
        if not self.ensure():
            return None
        assert self._sock is not None
        pipe: tuple[int, int] | None = None
        if learn and not self._learning_off:
            pipe = os.pipe2(os.O_CLOEXEC)
            fds = [*fds, pipe[1]]
        req = {
            "argv": argv,
            "env": env,
            "cwd": cwd,
            "launcher_pid": os.getpid(),
            "threads": _default_threads(),
        }
        reply = self._ask(req, fds)
        if pipe is not None:
            os.close(pipe[1])
            ok = bool(reply) and bool(json.loads(reply).get("ok"))
            if ok:
                threading.Thread(
                    target=self._listen, args=(pipe[0],), name="stalwart-learn", daemon=True
                ).start()
            else:
                os.close(pipe[0])
        if not reply:
            logger.warning("warm template vanished during a spawn; starting this worker cold")
            return None
        ans = json.loads(reply)
        if not ans.get("ok"):
            logger.warning("warm spawn refused (%s); starting this worker cold", ans.get("error"))
            self.emit(Event.WARM_SPAWN_REFUSED, reason=ans.get("error"))
            return None
        return int(ans["pid"])

    def _ask(self, req: dict[str, Any], fds: list[int]) -> bytes:
        """Sends one request with its descriptors; the template's reply (b"": it is gone)."""
        with self._lock:
            try:
                assert self._sock is not None
                socket.send_fds(self._sock, [json.dumps(req).encode()], fds)
                return self._sock.recv(1 << 16)
            except OSError as err:
                return json.dumps({"ok": False, "error": f"template unreachable: {err}"}).encode()

    def fork_link_check(self, fds: list[int]) -> int | None:
        """Forks the node's collective link check (``stalwart.health.linkrun``) with
        *fds* as its stdin, stdout and stderr; its pid (our child once the template's
        intermediate has exited), or None when it must start cold.  Waits while the
        template is still importing."""
        req = {"check": True, "launcher_pid": os.getpid()}
        reply = self._ask_while_importing(req, fds)
        if reply is None:
            if not self.ensure():
                return None
            reply = self._ask(req, fds)
        ans: dict[str, Any] = (
            json.loads(reply) if reply else {"ok": False, "error": "the template vanished"}
        )
        if not ans.get("ok"):
            logger.warning(
                "the link check starts cold: the template refused (%s)", ans.get("error")
            )
            return None
        return int(ans["pid"])

    def _ask_while_importing(self, req: dict[str, Any], fds: list[int]) -> bytes | None:
        """Asks a template that is still importing: it forks the check once torch's
        distributed package is in (``zygote.early_link_check``), or once it is ready
        when the request came too late for that; its word of readiness, should it come
        first, is taken on the way. None: the template is ready (or there is none), ask
        as usual."""
        with self._lock:
            if self._ready or self._closing or self.disabled_reason is not None:
                return None
            if self._sock is None or not self._alive():
                return None
            try:
                socket.send_fds(self._sock, [json.dumps(req).encode()], fds)
            except OSError:
                return None
            while True:
                msg = self._next_message()
                if msg is None:
                    return b""
                if not msg or "ready" in json.loads(msg):
                    if not self._on_ready(msg):
                        return b""
                    continue
                return msg

    def template_pid(self) -> int | None:
        return self._proc.pid if self._alive() and self._proc is not None else None

    def owned_pids(self) -> set[int]:
        """Every template process our ``Popen``s own: the serving one and one being
        prepared with learned modules."""
        with self._lock:
            nxt = self._next
            return {p.pid for p in (self._proc, nxt[0] if nxt else None) if p is not None}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No template is forked, started or retired while this is held: a caller that
        scans the launcher's children for strays and spares ``owned_pids()`` sees every
        template it must spare (a learned one forked mid-scan would look like an orphan)."""
        with self._lock:
            yield

    def _shutdown(self) -> None:
        _stop(self._proc, self._sock)
        self._sock = None
        self._proc = None
        self._ready = False

    def stop_learning(self) -> None:
        """The launcher's teardown began: no template is forked or started from now on,
        and one being prepared with learned modules is stopped.  The serving template
        stays until ``close``.  Safe to call more than once."""
        with self._lock:
            self._closing = True
            self._learning_off = True
            if self._next is not None:
                # Its socket shut, the thread waiting for it to be ready wakes at once.
                _stop(*self._next)
                self._next = None

    def close(self) -> None:
        """Stops every template; when it returns none is left, none will be forked and no
        event of ours follows.  Safe to call more than once."""
        self.stop_learning()
        with self._lock:
            self._shutdown()
            learner = self._learner
        self._learn_queue.put(None)
        if learner is not None and learner is not threading.current_thread():
            # Bounded: all it could wait on (a template's reply, a learned template's
            # readiness) was just stopped.
            learner.join(self.ready_timeout)


def _stop(proc: Template | None, sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            # Wakes a thread blocked in recv() on it (close() alone would not).
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
    if proc is not None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _default_threads() -> int:
    """The intra-op thread count a cold worker without OMP_NUM_THREADS would get: the
    template imported torch with one thread (so that it can fork), the worker restores it."""
    torch = sys.modules.get("torch")
    if torch is not None and envvars.OMP_NUM_THREADS not in os.environ:
        return int(torch.get_num_threads())
    return len(os.sched_getaffinity(0))
