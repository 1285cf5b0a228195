"""The writer subprocess's main loop.

Runs in the writer child (see ``seed.py`` for how it starts): calls the user's init function, builds the writer,
then serves ping / write / exit requests one at a time until told to exit or
until the parent goes away (its end of the pipe closes).
"""

from __future__ import annotations

import inspect
import logging
import os
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, Protocol

from .messages import Request, RequestKind, Response, ResponseKind, WritePayload
from .staging import BufferView

logger = logging.getLogger(__name__)


class CheckpointWriter(Protocol):
    """What a writer factory must build; it runs inside the child.

    ``write`` is called with keywords, ``write(path=..., state_dict=...,
    **kwargs)``, like torch's experimental checkpoint process calls its writers,
    so a writer written for torch runs unchanged. A writer whose ``write`` names
    a ``release`` parameter also gets ``release=``: it must call it as soon as it
    no longer reads ``state_dict`` (its tensors alias the shared staging buffer);
    the parent can then stage the next snapshot while this one is still being
    fsync'd. Otherwise (and if it never calls it) the buffer is released when
    ``write`` returns. A ``write`` that returns a ``concurrent.futures.Future``
    (torch's signature allows one) is waited for.
    """

    def write(
        self, state_dict: Any, path: str, *, release: Callable[[], None], **kwargs: Any
    ) -> Any: ...


def write_call_style(write: Callable[..., Any]) -> bool:
    """Check that ``write`` can be called as ``write(path=..., state_dict=..., ...)``;
    return whether it takes ``release=``. Raises TypeError with a one-line reason."""
    try:
        params = inspect.signature(write).parameters
    except (TypeError, ValueError):
        return False  # a builtin without a signature: call it and see
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name in ("path", "state_dict"):
        param = params.get(name)
        ok = (param is not None and param.kind is not inspect.Parameter.POSITIONAL_ONLY) or (
            param is None and var_kw
        )
        if not ok:
            raise TypeError(
                f"the writer's write{inspect.signature(write)} does not take {name}= by "
                "keyword; expected write(path, state_dict, **kwargs) as torch's CheckpointWriter"
            )
    release = params.get("release")
    return release is not None and release.kind is not inspect.Parameter.POSITIONAL_ONLY


def _failure(seq: int, exc: BaseException) -> Response:
    errno_value = None
    cur: BaseException | None = exc
    while cur is not None:
        if isinstance(cur, OSError) and cur.errno is not None:
            errno_value = cur.errno
            break
        cur = cur.__cause__ or cur.__context__
    return Response(
        ResponseKind.FAILED,
        seq,
        error_message=f"{type(exc).__name__}: {exc}",
        error_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        error_errno=errno_value,
        traceback=traceback.format_exc(),
    )


def report_start_failure(conn: Connection, exc: BaseException) -> None:
    """Answers the parent's start-up handshake with the reason the writer cannot start."""
    conn.send(_failure(0, exc))
    conn.close()


def _serve_write(
    conn: Connection,
    writer: CheckpointWriter,
    takes_release: bool,
    view: BufferView,
    seq: int,
    payload: WritePayload,
) -> Any:
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            conn.send(Response(ResponseKind.RELEASED, seq))

    state = view.unstage(payload.state)
    extra: dict[str, Any] = {"release": release} if takes_release else {}
    try:
        result = writer.write(path=payload.path, state_dict=state, **extra, **payload.kwargs)
        if isinstance(result, Future):
            result = result.result()
        return result
    finally:
        del state
        release()


def _housekeeping(writer: CheckpointWriter) -> None:
    # Optional hook: work that must not delay the caller's Future (retention).
    hook = getattr(writer, "housekeeping", None)
    if hook is None:
        return
    try:
        hook()
    except Exception:
        logger.exception("checkpoint housekeeping failed")


def writer_main(
    conn: Connection,
    buffer_fd: int,
    init_fn: Callable[..., None] | None,
    init_args: tuple[Any, ...],
    writer_factory: Callable[..., CheckpointWriter],
    writer_kwargs: dict[str, Any],
    log_level: int,
    nice: int = 0,
) -> None:
    """Entry point of the writer subprocess."""
    logging.basicConfig(level=log_level, format="[ckpt-writer %(process)d] %(message)s")
    if nice:
        try:
            os.nice(nice)
        except OSError as exc:
            logger.debug("could not lower the writer's priority: %s", exc)
    seq = 0
    try:
        if init_fn is not None:
            init_fn(*init_args)
        writer = writer_factory(**writer_kwargs)
        takes_release = write_call_style(writer.write)
        view = BufferView(buffer_fd)
    except BaseException as exc:
        # The parent is waiting for the handshake; answer it with the reason.
        report_start_failure(conn, exc)
        return
    logger.debug("writer ready in pid %d", os.getpid())
    while True:
        try:
            req: Request = conn.recv()
        except (EOFError, OSError):
            logger.debug("parent closed the pipe; exiting")
            return
        seq = req.seq
        if req.kind is RequestKind.PING:
            conn.send(Response(ResponseKind.PONG, seq))
        elif req.kind is RequestKind.EXIT:
            conn.send(Response(ResponseKind.BYE, seq))
            conn.close()
            return
        elif req.kind is RequestKind.WRITE and req.payload is not None:
            try:
                result = _serve_write(conn, writer, takes_release, view, seq, req.payload)
            except Exception as exc:
                logger.warning("checkpoint write failed: %s", exc)
                conn.send(_failure(seq, exc))
            else:
                conn.send(Response(ResponseKind.DONE, seq, result=result))
                _housekeeping(writer)
        else:
            conn.send(_failure(seq, ValueError(f"unknown request {req.kind!r}")))
