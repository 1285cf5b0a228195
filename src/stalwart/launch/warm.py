"""The launcher's side of warm starts: owns the template process and asks it for workers.

The template (``zygote.py``) is started as soon as the supervisor starts, so its imports
overlap the rendezvous; a worker start waits for it only as long as it is still
importing.  If the template cannot be used (a preload fails, it is unsafe to fork, it
died and cannot be restarted) ``spawn`` returns None and the caller starts the worker
cold; the reason is logged once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from stalwart.launch import posix
from stalwart.launch.runfiles import APPEND_FLAGS

logger = logging.getLogger(__name__)

EventSink = Callable[..., Any]


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
                    if not _exists(self.pid):
                        self.returncode = -int(signal.SIGKILL)
                    return self.returncode
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class WarmPool:
    """One template process per node; forks workers that start with torch imported."""

    def __init__(
        self,
        preload: list[str],
        env: dict[str, str],
        emit: EventSink,
        ready_timeout: float = 120.0,
        log_path: str = os.devnull,
    ) -> None:
        self.preload = preload
        self.log_path = log_path
        self.env = env
        self.emit = emit
        self.ready_timeout = ready_timeout
        self.disabled_reason: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self._lock = threading.Lock()

    # -- the template's life -----------------------------------------------------------
    def start(self) -> None:
        """Starts the template without waiting for its imports."""
        if self.disabled_reason is not None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        # Import-time chatter of the template goes to its own log, not the job's console;
        # why it is unusable reaches the launcher as one message on the socket.
        log = os.open(self.log_path, APPEND_FLAGS, 0o644)
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-u",
                "-m",
                "stalwart.launch.zygote",
                "--sock",
                str(theirs.fileno()),
                "--preload",
                ",".join(self.preload),
            ],
            pass_fds=[theirs.fileno()],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # terminal signals are the launcher's to forward
            preexec_fn=lambda: posix.pdeathsig_then_check(parent),
        )
        os.close(log)
        theirs.close()
        self._sock = ours
        self._ready = False
        self.emit("template_start", template_pid=self._proc.pid, preload=self.preload)

    def _await_ready(self) -> bool:
        if self._ready:
            return True
        assert self._sock is not None and self._proc is not None
        self._sock.settimeout(self.ready_timeout)
        try:
            msg = self._sock.recv(1 << 16)
        except TimeoutError:
            return self._give_up(
                f"the template did not finish importing in {self.ready_timeout:g}s"
            )
        except OSError as err:
            return self._give_up(f"the template is unreachable ({err})")
        finally:
            self._sock.settimeout(None)
        if not msg:
            return self._give_up(f"the template exited (code {self._proc.wait()})")
        info = json.loads(msg)
        if not info.get("ready"):
            return self._give_up(str(info.get("error", "the template is not usable")))
        self._ready = True
        self.emit(
            "template_ready",
            template_pid=self._proc.pid,
            rss_bytes=info.get("rss"),
            import_s=info.get("import_s"),
            modules=info.get("modules"),
        )
        return True

    def _give_up(self, reason: str) -> bool:
        self.disabled_reason = reason
        logger.warning("warm start disabled, starting workers cold: %s", reason)
        self.emit("template_unusable", reason=reason)
        self._shutdown()
        return False

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ensure(self) -> bool:
        """True when a usable template is running; restarts one that died."""
        with self._lock:
            if self.disabled_reason is not None:
                return False
            if self._proc is not None and not self._alive():
                code = self._proc.returncode
                self.emit("template_died", template_pid=self._proc.pid, exitcode=code)
                logger.warning("warm template died (exit %s); starting a new one", code)
                self._shutdown()
                self.start()
            if self._proc is None:
                self.start()
            return self._await_ready()

    # -- workers -----------------------------------------------------------------------
    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> int | None:
        """Forks a worker that runs ``argv`` (``[-m] TARGET ARGS``); its pid, or None if
        the caller must start it cold."""
        if not self.ensure():
            return None
        assert self._sock is not None
        req = {
            "argv": argv,
            "env": env,
            "cwd": cwd,
            "launcher_pid": os.getpid(),
            "threads": _default_threads(),
        }
        with self._lock:
            try:
                socket.send_fds(self._sock, [json.dumps(req).encode()], fds)
                reply = self._sock.recv(1 << 16)
            except OSError as err:
                reply = json.dumps({"ok": False, "error": f"template unreachable: {err}"}).encode()
        if not reply:
            logger.warning("warm template vanished during a spawn; starting this worker cold")
            return None
        ans = json.loads(reply)
        if not ans.get("ok"):
            logger.warning("warm spawn refused (%s); starting this worker cold", ans.get("error"))
            self.emit("warm_spawn_refused", reason=ans.get("error"))
            return None
        return int(ans["pid"])

    def owned_pid(self) -> int | None:
        """The template's pid while our ``Popen`` still owns it (alive or not yet reaped)."""
        return self._proc.pid if self._proc is not None else None

    def template_pid(self) -> int | None:
        return self._proc.pid if self._alive() and self._proc is not None else None

    def _shutdown(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None
        self._ready = False

    def close(self) -> None:
        with self._lock:
            self._shutdown()


def _default_threads() -> int:
    """The intra-op thread count a cold worker without OMP_NUM_THREADS would get: the
    template imported torch with one thread (so that it can fork), the worker restores it."""
    torch = sys.modules.get("torch")
    if torch is not None and "OMP_NUM_THREADS" not in os.environ:
        return int(torch.get_num_threads())
    return len(os.sched_getaffinity(0))
