"""Starting, watching and stopping one node's workers.

A worker is a Python function (run in a ``multiprocessing`` child, its return value sent
back) or a program (a script through our bootstrap, a module, or any binary).  Every
worker leads its own process group so a signal reaches its children too, carries the
kernel's parent-death signal and the run token the guardian hunts for, and has its
exit time taken from a pidfd the moment it dies, so the root cause is the earliest
failure and not the first one noticed.

``ProcessContext`` follows torch elastic's contract: ``poll()`` is all-or-nothing (a
result once every worker succeeded or any failed), ``wait(timeout, period)``,
``pids()``, ``close(death_sig, timeout)`` with TERM -> KILL escalation.  What the
workers started that a group kill would miss is found and killed by ``strays.StrayScan``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from stalwart.base import envvars, procs
from stalwart.config.secret import JOB_SECRET_ENV, worker_environ
from stalwart.launch.files.logs import Tee, WorkerLogs
from stalwart.launch.files.redirects import open_regular
from stalwart.launch.files.runfiles import APPEND_FLAGS
from stalwart.launch.workers import posix
from stalwart.launch.workers.cgroup import JobCgroup
from stalwart.launch.workers.errors import record
from stalwart.launch.workers.failures import read_failure
from stalwart.launch.workers.guardian import Guardian
from stalwart.launch.workers.strays import StrayScan, children_of
from stalwart.launch.workers.warm import ForkedProcess, WarmPool
from stalwart.monitor import stacks
from stalwart.rendezvous.api import WorkerFailed

logger = logging.getLogger(__name__)

# How long to wait for a SIGKILLed worker to be reaped before declaring it unkillable
# (a process in uninterruptible sleep dies only when its I/O returns).
KILL_WAIT = 5.0
# The parent's word to a function worker that its return value was read.
_VALUE_READ = b"read"


@dataclass
class RunResult:
    """Outcome of a worker group, keyed by local rank.  All-or-nothing: either every
    worker succeeded (``return_values`` full, ``failures`` empty) or ``failures`` says
    which ones failed and ``return_values`` is empty."""

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, WorkerFailed] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return bool(self.failures)


@dataclass
class _Worker:
    local_rank: int
    pid: int
    proc: subprocess.Popen[bytes] | ForkedProcess | mp.process.BaseProcess
    logs: WorkerLogs
    rank: int | None
    conn: Connection | None = None  # function workers: return value channel
    exited_at: float | None = None
    returned: bool = False
    value: Any = None

    def exitcode(self) -> int | None:
        if isinstance(self.proc, subprocess.Popen | ForkedProcess):
            code = self.proc.poll()
        else:
            code = self.proc.exitcode
        if code is not None and self.exited_at is None:
            # The exit watcher missed it (it stops at the teardown): the moment it was
            # seen gone is the closest bound there is.
            self.exited_at = time.time()
        return code


def _function_child(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    stdout: str | None,
    stderr: str | None,
    console: bool,
    conn: Connection,
    parent: int,
    recorder: Callable[[Callable[..., Any]], Callable[..., Any]] = record,
) -> None:
    """Body of a function worker (runs in the child); *recorder* wraps *fn* so that its
    failure lands in the error file."""
    os.setpgid(0, 0)
    server = os.getppid()
    if server != parent and procs.parent(server) == parent:
        # Started through a forkserver: our parent is the server the launcher started,
        # which ends when the launcher does; checking for the launcher as our parent
        # would end every forkserver worker at once.
        procs.pdeathsig_then_check(server)
    else:
        procs.pdeathsig_then_check(parent)
    for fdno, path in ((1, stdout), (2, stderr)):
        if path is not None:
            fd = _open_log(path)
        elif not console:
            fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        else:
            continue
        os.dup2(fd, fdno)
        os.close(fd)
    os.environ.update(env)
    # Inherited from the launcher at the child's start: not the program's to see.
    os.environ.pop(JOB_SECRET_ENV, None)
    # After the env: the dump goes where this worker's STALWART_STACKS_FILE says, as a
    # program worker's does.
    stacks.install()
    ret = recorder(fn)(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(ret)
    # With torch.multiprocessing imported, a tensor travels as a shared-memory handle that
    # the parent can open only while this process lives: stay until it says it has read
    # the value (EOF when it died). Its word, not EOF alone: a forked child holds a copy
    # of the parent's end, which would keep the channel open for good.
    try:
        conn.recv_bytes(len(_VALUE_READ))
    except (EOFError, OSError):
        pass
    conn.close()


def _stdin_or_devnull(opened: list[int]) -> int:
    """Our stdin for a warm worker, as Popen would inherit it; /dev/null when we have none
    (CI runs without standard input, and a closed fd cannot be passed to the template)."""
    try:
        os.fstat(0)
        return 0
    except OSError:
        fd = os.open(os.devnull, os.O_RDONLY)
        opened.append(fd)
        return fd


def _open_log(path: str | os.PathLike[str]) -> int:
    """A worker's log file for appending. A FIFO, link or device a stranger planted at
    the path (a log folder others can write to) is a one-line `ValueError`: the open
    neither waits for a reader nor writes through to one."""
    return open_regular(path, APPEND_FLAGS | os.O_NONBLOCK, "worker log")


def _open_stream(path: Path | None, console: bool) -> int | None:
    if path is not None:
        return _open_log(path)
    return None if console else subprocess.DEVNULL


@dataclass
class WorkerSpecEntry:
    """What one local worker runs: entrypoint, arguments, environment and logs."""

    local_rank: int
    args: tuple[Any, ...]
    env: dict[str, str]
    logs: WorkerLogs
    rank: int | None = None


class ProcessContext(StrayScan):
    """A group of workers started together and watched as one."""

    def __init__(
        self,
        entrypoint: Callable[..., Any] | str,
        workers: Sequence[WorkerSpecEntry],
        *,
        start_method: str = "spawn",
        run_token: str = "",
        guardian: Guardian | None = None,
        autoclose: bool = True,
        warm: WarmPool | None = None,
        warm_argv: list[str] | None = None,
        wait_all: bool = False,
        cgroup: JobCgroup | None = None,
        adopt_orphans: bool = False,
        recorder: Callable[[Callable[..., Any]], Callable[..., Any]] = record,
    ) -> None:
        self.entrypoint = entrypoint
        # What wraps a function worker's entrypoint in the child (a module-level function:
        # spawn and forkserver pickle it): stalwart's `record` writes an error file for a
        # non-zero SystemExit too; torch's compat `record` writes none for it.
        self.recorder = recorder
        self.specs = list(workers)
        self.start_method = start_method
        self.run_token = run_token
        self.guardian = guardian
        # False: poll() reports a result but leaves stopping the rest to the caller (the
        # supervisor first tells the hang monitor to stop judging the workers).
        self.autoclose = autoclose
        # Program workers that the warm template can fork instead (argv for run_target).
        self.warm = warm
        self.warm_argv = warm_argv
        # True: a failed worker does not end the group; poll() reports once every worker
        # has exited (the in-process restart policy, where survivors carry on without it).
        self.wait_all = wait_all
        # Workers join the job's cgroup before they run anything, so all they start is
        # born in it; teardown kills its members (all but the warm template).
        self.cgroup = cgroup
        # True (the supervisor, a child subreaper whose children are all the job's):
        # children re-parented to us that we did not start are the workers' orphans
        # (a daemon that left with setsid and a cleared environment) and die with them.
        self.adopt_orphans = adopt_orphans
        self._preexisting: set[int] = set()
        self._workers: dict[int, _Worker] = {}
        self._watcher = posix.ExitWatcher()
        self._tee = Tee()
        self._result: RunResult | None = None
        self._closed = False

    # -- starting ---------------------------------------------------------------------
    def _env(self, spec: WorkerSpecEntry) -> dict[str, str]:
        env = worker_environ(os.environ)
        env.update(spec.env)
        if spec.logs.error_file is not None:
            env[envvars.ERROR_FILE] = str(spec.logs.error_file)
        env[envvars.LAUNCHER_PID] = str(os.getpid())
        if self.run_token:
            env[envvars.RUN_TOKEN] = self.run_token
        return env

    def start(self, copy_output: bool = True) -> None:
        """Starts the workers; without `copy_output`, teeing their output to the console
        waits for `start_output` (torch's contexts start their log tails after)."""
        if self._workers:
            raise RuntimeError("ProcessContext.start() called twice")
        if self.adopt_orphans:
            self._preexisting = set(children_of(os.getpid(), recursive=False))
        for spec in self.specs:
            try:
                if callable(self.entrypoint):
                    w = self._start_function(spec)
                else:
                    w = self._start_program(spec)
            except BaseException:
                # One worker could not start (a log path refused): the ones already
                # running must not outlive the error.
                self.close()
                raise
            self._workers[spec.local_rank] = w
            if self.guardian is not None:
                self.guardian.register(w.pid)
            self._watcher.watch(w)
            if spec.logs.tee_stdout and spec.logs.stdout is not None:
                self._tee.add(spec.logs.stdout, sys.stdout, spec.logs.prefix)
            if spec.logs.tee_stderr and spec.logs.stderr is not None:
                self._tee.add(spec.logs.stderr, sys.stderr, spec.logs.prefix)
        self._watcher.start()
        if copy_output:
            self._tee.start()

    def start_output(self) -> None:
        """Starts copying the workers' output to the console (after `start(False)`)."""
        self._tee.start()

    def _start_warm(self, spec: WorkerSpecEntry) -> _Worker | None:
        assert self.warm is not None and self.warm_argv is not None
        opened: list[int] = []

        def stream(path: Path | None, console_fd: int, console: bool) -> int:
            if path is None and console:
                return console_fd
            fd = (
                _open_log(path)
                if path is not None
                else os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            )
            opened.append(fd)
            return fd

        try:
            fds = [
                _stdin_or_devnull(opened),
                stream(spec.logs.stdout, 1, spec.logs.console),
                stream(spec.logs.stderr, 2, spec.logs.console),
            ]
            pid = self.warm.spawn(
                self.warm_argv, self._env(spec), os.getcwd(), fds, learn=spec.local_rank == 0
            )
        finally:
            for fd in opened:
                os.close(fd)
        if pid is None:
            return None
        if self.cgroup is not None:
            # Already a member when the template is one; a restarted template is not.
            self.cgroup.join(pid)
        return _Worker(spec.local_rank, pid, ForkedProcess(pid), spec.logs, spec.rank)

    def _start_program(self, spec: WorkerSpecEntry) -> _Worker:
        assert isinstance(self.entrypoint, str)
        if self.warm is not None and self.warm_argv is not None:
            warm = self._start_warm(spec)
            if warm is not None:
                return warm
        out = _open_stream(spec.logs.stdout, spec.logs.console)
        err = _open_stream(spec.logs.stderr, spec.logs.console)
        parent = os.getpid()
        cgroup = self.cgroup

        def prepare() -> None:
            if cgroup is not None:
                cgroup.join()
            procs.pdeathsig_then_check(parent)

        try:
            proc = subprocess.Popen(
                [self.entrypoint, *map(str, spec.args)],
                env=self._env(spec),
                stdout=out,
                stderr=err,
                start_new_session=True,  # as torchrun's workers: own session and group
                preexec_fn=prepare,
            )
        finally:
            for fd in (out, err):
                if fd is not None and fd >= 0:
                    os.close(fd)
        return _Worker(spec.local_rank, proc.pid, proc, spec.logs, spec.rank)

    def _start_function(self, spec: WorkerSpecEntry) -> _Worker:
        assert callable(self.entrypoint)
        ctx: Any = mp.get_context(self.start_method)
        # Duplex: the child waits on its end for the parent to close ours (see below).
        for path in (spec.logs.stdout, spec.logs.stderr):
            if path is not None:
                # Opened here first, so a planted FIFO or link is the launcher's one-line
                # error, as for a program worker; the child opens it the same way.
                os.close(_open_log(path))
        recv, send = ctx.Pipe(duplex=True)
        env = self._env(spec)
        proc = ctx.Process(
            target=_function_child,
            args=(
                self.entrypoint,
                spec.args,
                env,
                str(spec.logs.stdout) if spec.logs.stdout else None,
                str(spec.logs.stderr) if spec.logs.stderr else None,
                spec.logs.console,
                send,
                os.getpid(),
                self.recorder,
            ),
            name=f"stalwart-worker-{spec.local_rank}",
        )
        # The child applies *env* itself once running, which /proc/<pid>/environ (what the
        # guardian's token sweep reads) never shows: a function worker is covered by its
        # process group and parent-death signal, the programs it starts by the token.
        proc.start()
        send.close()
        assert proc.pid is not None
        if self.cgroup is not None:
            # The child is still starting its interpreter: it joins before the target runs.
            self.cgroup.join(proc.pid)
        return _Worker(spec.local_rank, proc.pid, proc, spec.logs, spec.rank, conn=recv)

    # -- watching ---------------------------------------------------------------------
    def pids(self) -> dict[int, int]:
        return {lr: w.pid for lr, w in self._workers.items()}

    def _collect_return_values(self) -> None:
        for w in self._workers.values():
            if w.conn is not None and not w.returned:
                try:
                    if w.conn.poll():
                        w.value = w.conn.recv()
                        w.returned = True
                        # Read: the child, waiting for this, may now exit.
                        w.conn.send_bytes(_VALUE_READ)
                        w.conn.close()
                except (EOFError, OSError):
                    pass

    def poll(self) -> RunResult | None:
        """A result once all workers succeeded or any failed (then the rest are stopped)."""
        if self._result is not None:
            return self._result
        self._collect_return_values()
        failures: dict[int, WorkerFailed] = {}
        running = 0
        for lr, w in self._workers.items():
            code = w.exitcode()
            if code is None:
                running += 1
            elif code != 0:
                failures[lr] = self._failure(w, code)
        if failures and not (self.wait_all and running):
            self._result = RunResult(failures=failures)
            self._fill_paths(self._result)
            if self.autoclose:
                self.close()
            return self._result
        if running:
            return None
        self._collect_return_values()
        values = {lr: (w.value if w.conn is not None else None) for lr, w in self._workers.items()}
        self._result = RunResult(return_values=values)
        self._fill_paths(self._result)
        if self.autoclose:
            self.close()
        return self._result

    def _failure(self, w: _Worker, code: int) -> WorkerFailed:
        return read_failure(
            w.local_rank,
            w.pid,
            code,
            exited_at=w.exited_at if w.exited_at is not None else time.time(),
            rank=w.rank,
            error_file=str(w.logs.error_file) if w.logs.error_file else "",
        )

    def _fill_paths(self, result: RunResult) -> None:
        for lr, w in self._workers.items():
            result.stdouts[lr] = str(w.logs.stdout or "")
            result.stderrs[lr] = str(w.logs.stderr or "")

    def wait(self, timeout: float = -1, period: float = 0.1) -> RunResult | None:
        """Blocks until ``poll()`` has a result or *timeout* s passed (negative: forever;
        zero: a single poll).  Wakes immediately when a worker exits."""
        if timeout == 0:
            return self.poll()
        deadline = None if timeout < 0 else time.monotonic() + timeout
        while True:
            self._watcher.changed.clear()
            result = self.poll()
            if result is not None:
                return result
            remaining = period if deadline is None else min(period, deadline - time.monotonic())
            if remaining <= 0:
                return None
            self._watcher.changed.wait(remaining)

    def output_stopped(self) -> bool:
        """True once no worker output is being copied to the console any more."""
        return self._tee.stopped()

    def exit_info(self) -> dict[int, tuple[int | None, int, int | None, float | None]]:
        """local rank -> (global rank, pid, exit code or None if running, exit time)."""
        return {lr: (w.rank, w.pid, w.exitcode(), w.exited_at) for lr, w in self._workers.items()}

    # -- stopping ---------------------------------------------------------------------
    def close(self, death_sig: int | None = None, timeout: float = 30.0) -> None:
        """Signals every worker's process group with *death_sig* (SIGTERM), waits up to
        *timeout* s, then SIGKILLs what is left, including stray descendants."""
        if self._closed:
            return
        self._closed = True
        sig = signal.SIGTERM if death_sig is None else death_sig
        workers = list(self._workers.values())
        # Taken before any signal: once a worker dies its descendants are re-parented and
        # no longer appear under it.
        descendants = self._descendants_of_workers([w.pid for w in workers if w.exitcode() is None])
        for w in workers:
            if w.exitcode() is None:
                logger.debug("sending %s to worker %d (pid %d)", sig, w.local_rank, w.pid)
                # The direct kill covers a function worker that has not yet made its group.
                try:
                    os.kill(w.pid, sig)
                except ProcessLookupError:
                    pass
            procs.killpg_quiet(w.pid, sig)
        deadline = time.monotonic() + max(timeout, 0.0)
        self._wait_exit(workers, deadline)
        for w in workers:
            procs.killpg_quiet(w.pid, signal.SIGKILL)
        self._kill_strays(descendants)
        if not self._wait_exit(workers, time.monotonic() + KILL_WAIT):
            for w in workers:
                if w.exitcode() is None:
                    logger.error(
                        "worker %d (pid %d) survives SIGKILL (uninterruptible sleep?); "
                        "giving up on it",
                        w.local_rank,
                        w.pid,
                    )
        self._collect_return_values()
        for w in workers:
            if w.conn is not None:
                w.conn.close()
            if self.guardian is not None:
                self.guardian.unregister(w.pid)
        self._watcher.close()
        self._tee.stop()

    def _wait_exit(self, workers: list[_Worker], deadline: float) -> bool:
        while True:
            self._collect_return_values()  # a child blocked sending its result must drain
            if all(w.exitcode() is not None for w in workers):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._watcher.changed.clear()
            self._watcher.changed.wait(min(left, 0.05))


def start_processes(
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, tuple[Any, ...]],
    envs: Mapping[int, dict[str, str]],
    logs: Mapping[int, WorkerLogs],
    *,
    start_method: str = "spawn",
    run_token: str = "",
    guardian: Guardian | None = None,
) -> ProcessContext:
    """Starts one worker per local rank of *args* and returns the running context.

    *entrypoint* is a function (return values collected per rank) or a program path
    (``args`` are its command-line arguments)."""
    if set(args) != set(envs) or set(args) != set(logs):
        raise ValueError(
            f"args, envs and logs must cover the same local ranks: "
            f"{sorted(args)} / {sorted(envs)} / {sorted(logs)}"
        )
    specs = [WorkerSpecEntry(lr, tuple(args[lr]), dict(envs[lr]), logs[lr]) for lr in sorted(args)]
    for s in specs:
        rank = s.env.get(envvars.RANK)
        s.rank = int(rank) if rank is not None and rank.isdigit() else None
    ctx = ProcessContext(
        entrypoint, specs, start_method=start_method, run_token=run_token, guardian=guardian
    )
    ctx.start()
    return ctx
