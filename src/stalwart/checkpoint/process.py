"""The parent's handle on one writer subprocess (one per rank).

Owns the child's life cycle (spawn, ping handshake, respawn after death,
shutdown), the shared staging buffer, and the single I/O thread that talks to
the child, so callers only ever wait for the snapshot copy, never for the disk.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing.connection as mpc
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, overload

import torch

from . import seed
from .child import CheckpointWriter
from .errors import WriterDiedError, WriterError
from .identity import RankInfo
from .messages import Request, RequestKind, Response, ResponseKind, StagedState, WritePayload
from .process_args import (
    CheckpointProcessConfig,
    WriterProcessConfig,
    resolve_process_args,
)
from .staging import SharedBuffer, StagingPlan, plan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyStats:
    """Tensor bytes the parent's ``write`` calls copied into the shared buffer, and
    bytes they found staged there already (see :meth:`CheckpointProcess.lend`)."""

    copied_bytes: int
    in_place_bytes: int


class CheckpointProcess:
    """A writer subprocess with an asynchronous ``write`` API.

    Built either as ``CheckpointProcess(writer_factory, writer_kwargs, *,
    init_fn, init_args, config, rank_info)`` or exactly like torch's
    experimental ``CheckpointProcess(rank_info, config, subprocess_init_fn,
    subprocess_init_args, checkpoint_writer_init_fn, checkpoint_writer_init_args)``
    (see :func:`resolve_process_args`). The writer's ``write`` is called with
    keywords, ``write(path=..., state_dict=..., **kwargs)``, as torch does, plus
    ``release=`` when its signature names that parameter.

    The child starts in the background as soon as this object is built (see
    ``seed.py``: forked from a seed a warm worker prepared, else a fresh interpreter
    that never imports the caller's ``__main__``); ``wait_ready`` blocks until it
    answered the ping.  An init function or writer defined in ``__main__`` can only be
    found by re-importing it, so then the child is started with multiprocessing's
    ``spawn``, as torch does, and the script needs its ``if __name__ == "__main__":``
    guard; define them in an importable module to need none.
    ``write`` returns a Future at once: the caller only pays for the snapshot
    copy into shared memory.
    """

    @overload
    def __init__(
        self,
        writer_factory: Callable[..., CheckpointWriter],
        writer_kwargs: dict[str, Any] | None = None,
        *,
        init_fn: Callable[..., None] | None = None,
        init_args: tuple[Any, ...] = (),
        config: WriterProcessConfig | None = None,
        rank_info: RankInfo | None = None,
    ) -> None: ...

    @overload
    def __init__(
        self,
        rank_info: Any,
        config: CheckpointProcessConfig | WriterProcessConfig | Any,
        subprocess_init_fn: Callable[..., None] | None,
        subprocess_init_args: tuple[Any, ...],
        checkpoint_writer_init_fn: Callable[..., Any],
        checkpoint_writer_init_args: dict[str, Any],
    ) -> None: ...

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        spec = resolve_process_args(args, kwargs)
        self.config = spec.config
        self._writer_factory = spec.writer_factory
        self._writer_kwargs = spec.writer_kwargs
        self._init_fn = spec.init_fn
        self._init_args = spec.init_args
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stalwart-ckpt-io")
        self._buffer = SharedBuffer(copy_threads=self.config.copy_threads)
        # Held from the moment a snapshot lands in the buffer until the child
        # says it stopped reading it: one buffer, so the next snapshot waits.
        self._buffer_free = threading.Semaphore(1)
        self._deferred_staged: threading.Event | None = None
        self._proc: seed.ChildProcess | None = None
        self.start_method: seed.StartMethod | None = None
        self._conn: mpc.Connection | None = None
        self._seq = itertools.count(1)
        self._closed = False
        self._wrote = False
        self._abandoned = False
        self._lock = threading.Lock()
        #: What ``write`` copied into the shared buffer and what it found there already.
        self.copy_stats = CopyStats(0, 0)
        self._ready = self._io.submit(self._first_start)

    # -- public API -------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """Pid of the live writer child; None while none is running."""
        proc = self._proc
        if proc is None or proc.pid is None or not proc.is_alive():
            return None
        return int(proc.pid)

    @property
    def process_creation_future(self) -> Future[None]:
        """Done when the first child answered its ping; fails as that start failed.

        torch's name, which its users wait on (``.result()``) before the first write.
        """
        return self._ready

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the first child answered its ping; re-raise a failed start."""
        self._ready.result(timeout)

    def write(self, state_dict: Any, path: str, **kwargs: Any) -> Future[Any]:
        """Snapshot ``state_dict`` (or, if it is a Future, its result later) and write it.

        For a plain state dict the snapshot is taken before returning, so the
        caller may mutate its tensors right after. A Future is resolved and
        staged on the I/O thread.
        """
        if isinstance(state_dict, Future):
            return self._submit_deferred(state_dict, path, kwargs)
        staging = plan(state_dict, self._buffer.lent)
        self.copy_stats = CopyStats(
            self.copy_stats.copied_bytes + sum(r.nbytes for _, r, _ in staging.copies),
            self.copy_stats.in_place_bytes + staging.in_place_bytes,
        )
        return self.write_planned(staging, path, background=False, **kwargs)

    def lend(self, nbytes: int) -> torch.Tensor:
        """The head of the shared buffer, ``nbytes`` long (uint8), to stage into directly.

        Waits until the writer stopped reading the buffer (its previous write
        released it). Tensors a later :meth:`write` finds inside it are written from
        where they are, without a copy; the caller must not change them until that
        write released the buffer.
        """
        self._check_open()
        self._wait_for_deferred()
        self._buffer_free.acquire()
        try:
            return self._buffer.lend(nbytes)
        finally:
            self._buffer_free.release()

    def write_planned(
        self, staging: StagingPlan, path: str, *, background: bool, **kwargs: Any
    ) -> Future[Any]:
        """Write an already-pickled plan; copy now, or on the I/O thread if ``background``."""
        self._check_open()
        if background:
            # One thread: nobody waits for this copy, and more would take cores
            # from the training thread that keeps running meanwhile.
            return self._submit_staging(
                lambda: self._buffer.copy_in(staging, check_versions=True, threads=1), path, kwargs
            )
        self._wait_for_deferred()
        self._buffer_free.acquire()
        try:
            staged = self._buffer.copy_in(staging)
        except BaseException:
            self._buffer_free.release()
            raise
        self._wrote = True
        return self._io.submit(self._write_job, staged, path, kwargs)

    def reserve(self, nbytes: int, *, provisional: bool = False) -> Future[None]:
        """Grow the staging buffer on the I/O thread ahead of the first save.

        ``provisional``: ``nbytes`` is an estimate; the next snapshot shrinks
        the buffer to what it really needs (plus the usual headroom).
        """
        self._check_open()
        return self._io.submit(self._reserve, nbytes, provisional)

    def _reserve(self, nbytes: int, provisional: bool = False) -> None:
        # Remapping under a copy in progress would pull the memory from under
        # it, so growth must own the buffer like a snapshot does. Never wait for
        # it, though: the holder's write may be queued behind this very job on
        # the I/O thread. A snapshot in flight sizes the buffer itself anyway.
        if not self._buffer_free.acquire(blocking=False):
            logger.debug("staging buffer busy; skipping the reservation")
            return
        try:
            self._buffer.ensure(nbytes, provisional=provisional, prefault=True)
        finally:
            self._buffer_free.release()

    def close(self, *, abandon_unused_start: bool = False) -> None:
        """Finish queued writes, ask the child to exit, kill it after the shutdown timeout.

        ``abandon_unused_start``: when no write was ever submitted and the child is still
        starting, kill it instead of waiting for a fresh interpreter to finish importing
        torch only to be told to leave (seconds; an in-process restart closes a
        checkpointer made inside the wrapped function on every fault). Off by default:
        torch's callers may count on their init function having run."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if abandon_unused_start and not self._wrote and not self._ready.done():
            # Flag first, then look for the child: _start_child publishes the child
            # first, then looks at the flag, so one of the two sees the other.
            self._abandoned = True
            proc = self._proc
            if proc is not None:
                logger.debug(
                    "checkpoint writer pid %s still starting, never used: killed", proc.pid
                )
                proc.kill()
        self._io.shutdown(wait=True)
        self._stop_child(graceful=True)
        self._buffer.close()

    def __enter__(self) -> CheckpointProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submission ---------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CheckpointProcess is closed")

    def _wait_for_deferred(self) -> None:
        # A deferred job queued earlier must take the buffer before we do, or we
        # would hold it while our own job waits behind that one: a deadlock.
        evt = self._deferred_staged
        if evt is not None:
            evt.wait()

    def _submit_deferred(self, fut: Future[Any], path: str, kwargs: dict[str, Any]) -> Future[Any]:
        self._check_open()
        return self._submit_staging(
            lambda: self._buffer.copy_in(plan(fut.result()), threads=1), path, kwargs
        )

    def _submit_staging(
        self, stage_fn: Callable[[], StagedState], path: str, kwargs: dict[str, Any]
    ) -> Future[Any]:
        staged_evt = threading.Event()
        self._deferred_staged = staged_evt

        def job() -> Any:
            try:
                self._buffer_free.acquire()
                try:
                    staged = stage_fn()
                except BaseException:
                    self._buffer_free.release()
                    raise
            finally:
                staged_evt.set()
            return self._write_job(staged, path, kwargs)

        self._wrote = True
        result = self._io.submit(job)
        result.staged = staged_evt  # type: ignore[attr-defined]
        return result

    # -- I/O thread ---------------------------------------------------------

    def _write_job(self, staged: StagedState, path: str, kwargs: dict[str, Any]) -> Any:
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._buffer_free.release()

        try:
            self._ensure_child()
            seq = next(self._seq)
            self._send(Request(RequestKind.WRITE, seq, WritePayload(path, staged, kwargs=kwargs)))
            deadline = (
                None
                if self.config.write_timeout_s is None
                else time.monotonic() + self.config.write_timeout_s
            )
            while True:
                resp = self._recv(deadline, what=f"write of {path}")
                if resp.seq != seq:
                    logger.debug("dropping stale response %s", resp)
                    continue
                if resp.kind is ResponseKind.RELEASED:
                    release()
                elif resp.kind is ResponseKind.DONE:
                    return resp.result
                elif resp.kind is ResponseKind.FAILED:
                    raise _remote_error(resp)
                else:
                    raise WriterError(f"unexpected response {resp.kind} to a write")
        finally:
            # A dead or killed child no longer reads the buffer either.
            release()

    def _ensure_child(self) -> None:
        proc = self._proc
        if proc is not None and proc.is_alive() and self._conn is not None:
            return
        if proc is not None:
            logger.warning(
                "checkpoint writer (pid %s) is gone (exit code %s); starting a new one",
                proc.pid,
                proc.exitcode,
            )
            self._stop_child(graceful=False)
        self._start_child()

    def _first_start(self) -> None:
        if self._abandoned:
            raise WriterDiedError("checkpoint writer start abandoned: closed before any write")
        self._start_child()
        if self.config.reserve_bytes:
            self._reserve(self.config.reserve_bytes)

    def _start_child(self) -> None:
        # Never multiprocessing's spawn for our own writer: it would re-import (and so
        # re-run) a main module without an ``if __name__ == "__main__":`` guard.
        method, proc, parent_end = seed.start(
            (
                self._init_fn,
                self._init_args,
                self._writer_factory,
                self._writer_kwargs,
                self.config.log_level,
                self.config.writer_nice,
            ),
            self._buffer.fd,
        )
        self.start_method = method
        self._proc, self._conn = proc, parent_end
        if self._abandoned:
            self._stop_child(graceful=False)
            raise WriterDiedError("checkpoint writer start abandoned: closed before any write")
        seq = next(self._seq)
        try:
            self._send(Request(RequestKind.PING, seq))
            resp = self._recv(
                time.monotonic() + self.config.init_timeout_s, what="writer start-up", init=True
            )
        except BaseException:
            self._stop_child(graceful=False)
            raise
        if resp.kind is ResponseKind.FAILED:
            self._stop_child(graceful=False)
            raise _remote_error(resp)
        logger.debug("checkpoint writer pid %s ready", proc.pid)

    def _send(self, req: Request) -> None:
        assert self._conn is not None
        try:
            self._conn.send(req)
        except (OSError, ValueError) as exc:
            raise WriterDiedError(
                f"checkpoint writer (pid {self.pid}) is not reachable: {exc}"
            ) from exc

    def _recv(self, deadline: float | None, *, what: str, init: bool = False) -> Response:
        conn, proc = self._conn, self._proc
        assert conn is not None and proc is not None
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = mpc.wait([conn, proc.sentinel], timeout)
        if not ready:
            self._stop_child(graceful=False)
            if init:
                # Starts with "Timed out", the words torch's callers match on.
                raise TimeoutError(
                    f"Timed out: checkpoint writer (pid {proc.pid}) did not answer within "
                    f"{self.config.init_timeout_s:g} s of starting (init function stuck?)"
                )
            raise TimeoutError(f"{what} did not finish within {self.config.write_timeout_s} s")
        if conn in ready or conn.poll():
            try:
                resp: Response = conn.recv()
                return resp
            except (EOFError, OSError):
                pass
        proc.join(timeout=1.0)
        hint = (
            "; its init function or writer is defined in __main__, which the spawned "
            "child re-runs: a script without an `if __name__ == '__main__':` guard fails "
            "there (see the child's stderr)"
            if init and self.start_method is seed.StartMethod.SPAWN
            else ""
        )
        raise WriterDiedError(
            f"checkpoint writer (pid {proc.pid}) died during {what} "
            f"(exit code {proc.exitcode}){hint}"
        )

    def _stop_child(self, *, graceful: bool) -> None:
        proc, conn = self._proc, self._conn
        self._proc, self._conn = None, None
        if proc is None:
            return
        if graceful and proc.is_alive() and conn is not None:
            try:
                conn.send(Request(RequestKind.EXIT, next(self._seq)))
            except (OSError, ValueError):
                logger.debug("writer pipe already closed")
            proc.join(self.config.shutdown_timeout_s)
            if proc.is_alive():
                logger.warning(
                    "checkpoint writer (pid %s) did not exit within %g s; killing it",
                    proc.pid,
                    self.config.shutdown_timeout_s,
                )
        if proc.is_alive():
            proc.kill()
        proc.join(5.0)
        if conn is not None:
            conn.close()


def _remote_error(resp: Response) -> WriterError:
    return WriterError(
        resp.error_message,
        remote_type=resp.error_type,
        errno=resp.error_errno,
        remote_traceback=resp.traceback,
    )
