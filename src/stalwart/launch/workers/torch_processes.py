"""torch elastic's process-context API (``start_processes(name, entrypoint, args, envs,
logs_specs, ...)``, ``PContext``, ``DefaultLogsSpecs``, ``RunProcsResult``, ``Std``,
``SignalException``) over stalwart's ``ProcessContext``.

The workers are stalwart's: each leads its own process group, dies with its parent,
has its exit time taken from a pidfd, and its strays are killed at close. What differs
from torch: duplicate-line filters are applied once the workers have ended (torch
copies the lines as they come); ``numa_options`` is refused; torch's internals
(``MultiprocessContext._pc``, ``_poll``, ``_is_done``) do not exist.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import secrets
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from stalwart.base import envvars
from stalwart.config.output import Std, parse_std
from stalwart.launch.files.logs import LogSpec, WorkerLogs, std_map
from stalwart.launch.files.redirects import open_regular
from stalwart.launch.files.runfiles import APPEND_FLAGS
from stalwart.launch.workers.processes import ProcessContext, RunResult, WorkerSpecEntry
from stalwart.launch.workers.torch_errors import BadErrorFile, ProcessFailure
from stalwart.launch.workers.torch_errors import record as torch_record

logger = logging.getLogger(__name__)

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "MultiprocessContext",
    "PContext",
    "RunProcsResult",
    "SignalException",
    "Std",
    "SubprocessContext",
    "start_processes",
    "to_map",
]

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
# This system's signal names, read once: a name is looked up in `signal` only when it is
# one of them, so SIG_IGN (a handler constant equal to SIGHUP), NSIG or a typo is refused.
_SIGNAL_NAMES = frozenset(s.name for s in signal.Signals)
# Lines read per file when applying the duplicate filters: a worker's log can be huge.
_FILTER_LINE = 64 << 10


class SignalException(Exception):
    """Raised in the launcher's main thread by a termination signal, so that the caller
    can close its workers (``pc.close(e.sigval)``) instead of orphaning them."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


def _terminate_process_handler(signum: int, frame: FrameType | None) -> None:
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", signal.Signals(signum))


def _validate_full_rank(d: Mapping[int, Any], nprocs: int, what: str) -> None:
    if set(d) != set(range(nprocs)):
        raise RuntimeError(
            f"{what}: expected an entry for each local rank 0..{nprocs - 1}, got {sorted(d)}"
        )


def to_map(val_or_map: Std | dict[int, Std], local_world_size: int) -> dict[int, Std]:
    return std_map(val_or_map, local_world_size)


@contextlib.contextmanager
def _redirected(fdno: int, path: str) -> Iterator[None]:
    """The fd *fdno* (and so C code's output too) appends to *path* within the block.
    *path* is opened as every redirect destination is (``open_regular``): a FIFO, link or
    folder planted there is a ``ValueError`` before anything is switched, so the worker
    neither blocks waiting for a reader nor writes through a link."""
    if not path:
        yield
        return
    fd = open_regular(path, APPEND_FLAGS | os.O_NONBLOCK, f"redirect destination of fd {fdno}")
    (sys.stdout if fdno == 1 else sys.stderr).flush()
    saved = os.dup(fdno)
    try:
        os.dup2(fd, fdno)
        yield
    finally:
        (sys.stdout if fdno == 1 else sys.stderr).flush()
        os.dup2(saved, fdno)
        os.close(saved)
        os.close(fd)


def _wrap(
    local_rank: int,
    fn: Callable[..., Any],
    args: dict[int, tuple[Any, ...]],
    envs: dict[int, dict[str, str]],
    stdout_redirects: dict[int, str],
    stderr_redirects: dict[int, str],
    ret_vals: dict[int, Any],
    queue_finished_reading_event: Any,
    numa_options: object | None = None,
) -> None:
    """torch's function-worker body: runs ``fn`` with the rank's environment and streams,
    puts its return value on ``ret_vals[local_rank]`` and waits until it was read."""
    if numa_options is not None:
        raise ValueError(f"numa_options={numa_options!r}: NUMA binding is not supported")
    os.environ.update(envs[local_rank])
    with (
        _redirected(1, stdout_redirects.get(local_rank, "")),
        _redirected(2, stderr_redirects.get(local_rank, "")),
    ):
        ret = torch_record(fn)(*args[local_rank])
    ret_vals[local_rank].put(ret)
    queue_finished_reading_event.wait()


@dataclass
class RunProcsResult:
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return len(self.failures) > 0


@dataclass
class LogsDest:
    """Per local rank: the files its streams go to ("" for none) and its error file."""

    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    tee_stdouts: dict[int, str] = field(default_factory=dict)
    tee_stderrs: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)
    filtered_stdout: str = ""
    filtered_stderr: str = ""


class LogsSpecs(abc.ABC):
    """Where workers' output goes; `reify` makes the files for one start."""

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = local_ranks_filter

    @abc.abstractmethod
    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest: ...

    @property
    @abc.abstractmethod
    def root_log_dir(self) -> str: ...


class DefaultLogsSpecs(LogsSpecs):
    """torchrun's layout: ``<log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/``
    with ``stdout.log``, ``stderr.log`` and ``error.json``."""

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        if isinstance(redirects, str):
            redirects = parse_std(redirects, "redirects")
        if isinstance(tee, str):
            tee = parse_std(tee, "tee")
        if log_dir is not None and os.path.exists(log_dir) and not os.path.isdir(log_dir):
            raise NotADirectoryError(f"log_dir {log_dir!r} is a file; expected a directory")
        super().__init__(log_dir, redirects, tee, local_ranks_filter)
        self._run_dir: Path | None = None

    @property
    def root_log_dir(self) -> str:
        if self._root_log_dir is None:
            self._root_log_dir = tempfile.mkdtemp(prefix="stalwart_")
        return self._root_log_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        nprocs = len(envs)
        first = envs.get(0, {})
        if self._run_dir is None:
            run_id = first.get(envvars.RUN_ID, "none")
            self._run_dir = Path(self.root_log_dir) / f"{run_id}_{secrets.token_hex(4)}"
        attempt_text = first.get(envvars.RESTART_COUNT, "0")
        if not attempt_text.isdigit():
            raise ValueError(
                f"{envvars.RESTART_COUNT}={attempt_text!r}: expected a whole number >= 0"
            )
        spec = LogSpec(self._run_dir, self._redirects, self._tee, self._local_ranks_filter)
        plans = spec.make(int(attempt_text), nprocs, {lr: lr for lr in range(nprocs)}, "", 0)
        dest = LogsDest()
        for lr, plan in plans.items():
            dest.stdouts[lr] = str(plan.stdout or "")
            dest.stderrs[lr] = str(plan.stderr or "")
            dest.tee_stdouts[lr] = dest.stdouts[lr] if plan.tee_stdout else ""
            dest.tee_stderrs[lr] = dest.stderrs[lr] if plan.tee_stderr else ""
            dest.error_files[lr] = str(plan.error_file or "")
        adir = spec.attempt_dir(int(attempt_text))
        if adir is not None:
            dest.filtered_stdout = str(adir / "filtered_stdout.log")
            dest.filtered_stderr = str(adir / "filtered_stderr.log")
        return dest


class _OutputCopy:
    """torch's tail-log handle: ``stopped()`` once nothing more is copied."""

    def __init__(self, ctx: ProcessContext) -> None:
        self._ctx = ctx

    def start(self) -> None:
        self._ctx.start_output()

    def stopped(self) -> bool:
        return self._ctx.output_stopped()


class PContext:
    """A group of workers started together: ``start``, ``wait``, ``pids``, ``close``."""

    # True: a failed result also names the workers stopped because of the failure (with
    # the signal that stopped them), as torch's subprocess contexts do.
    _report_stopped = False

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        start_method: str = "spawn",
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
    ) -> None:
        self.name = name
        self.entrypoint = entrypoint
        nprocs = len(args)
        _validate_full_rank(args, nprocs, "args")
        _validate_full_rank(envs, nprocs, "envs")
        self.args = args
        self.envs = envs
        self.nprocs = nprocs
        dest = logs_specs.reify(envs)
        self.stdouts = dest.stdouts
        self.stderrs = dest.stderrs
        self.error_files = dest.error_files
        self._filters = {
            "stdout": (list(duplicate_stdout_filters or []), dest.filtered_stdout, self.stdouts),
            "stderr": (list(duplicate_stderr_filters or []), dest.filtered_stderr, self.stderrs),
        }
        self.filtered_stdout = dest.filtered_stdout if duplicate_stdout_filters else ""
        self.filtered_stderr = dest.filtered_stderr if duplicate_stderr_filters else ""
        prefixes = log_line_prefixes or {lr: f"[{name}{lr}]:" for lr in range(nprocs)}
        self._prefixes = prefixes
        specs = []
        for lr in range(nprocs):
            env = dict(envs[lr])
            rank = env.get(envvars.RANK)
            specs.append(
                WorkerSpecEntry(
                    lr,
                    tuple(args[lr]),
                    env,
                    WorkerLogs(
                        stdout=Path(self.stdouts[lr]) if self.stdouts[lr] else None,
                        stderr=Path(self.stderrs[lr]) if self.stderrs[lr] else None,
                        error_file=Path(self.error_files[lr]) if self.error_files[lr] else None,
                        tee_stdout=bool(dest.tee_stdouts[lr]),
                        tee_stderr=bool(dest.tee_stderrs[lr]),
                        prefix=prefixes.get(lr, ""),
                    ),
                    int(rank) if rank is not None and rank.isdigit() else None,
                )
            )
        # torch's `record`: a worker that exits with sys.exit(n) leaves no error file, so
        # its failure says "<N/A>" as under torch.
        self._ctx = ProcessContext(
            entrypoint, specs, start_method=start_method, recorder=torch_record
        )
        self._tail_logs = [_OutputCopy(self._ctx)]
        self._filtered = False

    def start(self) -> None:
        """Starts the workers; in the main thread, a termination signal then raises
        ``SignalException`` (the signals named by TORCHELASTIC_SIGNALS_TO_HANDLE)."""
        if threading.current_thread() is threading.main_thread():
            names = os.environ.get(envvars.SIGNALS_TO_HANDLE, DEFAULT_SIGNALS).split(",")
            for sig_name in (name.strip() for name in names):
                if sig_name not in _SIGNAL_NAMES:
                    logger.warning(
                        "%s names %r, which is no signal here; not handled",
                        envvars.SIGNALS_TO_HANDLE,
                        sig_name,
                    )
                    continue
                try:
                    signal.signal(getattr(signal, sig_name), _terminate_process_handler)
                except (OSError, RuntimeError, ValueError) as exc:
                    logger.warning("%s cannot be handled here (%s); not handled", sig_name, exc)
                    continue
                logger.info("Registered signal handler for %s: it raises SignalException", sig_name)
        else:
            logger.warning(
                "start_processes called outside the main thread: termination signals are not "
                "handled, so the workers outlive a killed launcher only until their "
                "parent-death signal"
            )
        self._start()
        for tail in self._tail_logs:
            tail.start()

    def _start(self) -> None:
        self._ctx.start(copy_output=False)

    def pids(self) -> dict[int, int]:
        return self._ctx.pids()

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """The result once every worker succeeded or any failed (the others are then
        stopped); None if *timeout* s passed first (negative: no limit)."""
        result = self._ctx.wait(timeout, period)
        return None if result is None else self._result(result)

    def _result(self, result: RunResult) -> RunProcsResult:
        self._apply_filters()
        failures: dict[int, ProcessFailure] = {}
        for lr, f in result.failures.items():
            try:
                failures[lr] = ProcessFailure(lr, f.pid, f.exitcode, f.error_file)
            except BadErrorFile as exc:
                logger.warning("local rank %d: %s; reported without it", lr, exc)
                failures[lr] = ProcessFailure(lr, f.pid, f.exitcode, "")
        if failures and self._report_stopped:
            for lr, (_, pid, code, _) in self._ctx.exit_info().items():
                if lr not in failures and code not in (None, 0):
                    failures[lr] = ProcessFailure(lr, pid, code, "")
        return RunProcsResult(
            return_values=dict(result.return_values),
            failures=failures,
            stdouts=dict(self.stdouts),
            stderrs=dict(self.stderrs),
        )

    def _apply_filters(self) -> None:
        """Copies the lines of the workers' log files that contain one of the filters,
        prefixed with the rank's prefix, into one file per stream."""
        if self._filtered:
            return
        self._filtered = True
        for patterns, target, files in self._filters.values():
            if not patterns or not target:
                continue
            with open(target, "w", encoding="utf-8", errors="replace") as out:
                for lr in range(self.nprocs):
                    if not files.get(lr):
                        continue
                    with open(files[lr], encoding="utf-8", errors="replace") as src:
                        while line := src.readline(_FILTER_LINE):
                            if any(p in line for p in patterns):
                                out.write(self._prefixes.get(lr, "") + line)

    def close(self, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        self._ctx.close(death_sig, float(timeout))


class MultiprocessContext(PContext):
    """Workers that run a Python function (its return value per rank)."""


class SubprocessContext(PContext):
    """Workers that run a program (``args`` are its command-line arguments)."""

    _report_stopped = True


def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: dict[int, tuple[Any, ...]],
    envs: dict[int, dict[str, str]],
    logs_specs: LogsSpecs,
    log_line_prefixes: dict[int, str] | None = None,
    start_method: str = "spawn",
    numa_options: object | None = None,
    duplicate_stdout_filters: list[str] | None = None,
    duplicate_stderr_filters: list[str] | None = None,
) -> PContext:
    """torch's ``start_processes``: one worker per local rank of *args*, started."""
    if numa_options is not None:
        raise ValueError(
            f"numa_options={numa_options!r}: NUMA binding is not supported; expected None"
        )
    if start_method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"start_method {start_method!r}: expected 'spawn', 'fork' or 'forkserver'")
    kind = SubprocessContext if isinstance(entrypoint, str) else MultiprocessContext
    context = kind(
        name,
        entrypoint,
        args,
        envs,
        logs_specs,
        log_line_prefixes,
        start_method,
        duplicate_stdout_filters,
        duplicate_stderr_filters,
    )
    try:
        context.start()
    except BaseException:
        context.close()
        raise
    return context
