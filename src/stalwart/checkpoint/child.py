"""The writer subprocess's main loop.

Runs in a spawned child: calls the user's init function, builds the writer,
then serves ping / write / exit requests one at a time until told to exit or
until the parent goes away (its end of the pipe closes).
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

from .messages import Request, RequestKind, Response, ResponseKind, WritePayload
from .staging import BufferView

logger = logging.getLogger(__name__)


class CheckpointWriter(Protocol):
    """What a writer factory must build; it runs inside the child.

    ``release`` must be called as soon as the writer no longer reads
    ``state_dict`` (its tensors alias the shared staging buffer); the parent can
    then stage the next snapshot while this one is still being fsync'd. If the
    writer never calls it, it is called when ``write`` returns.
    """

    def write(
        self, state_dict: Any, path: str, *, release: Callable[[], None], **kwargs: Any
    ) -> Any: ...


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


def _serve_write(
    conn: Connection, writer: CheckpointWriter, view: BufferView, seq: int, payload: WritePayload
) -> Any:
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            conn.send(Response(ResponseKind.RELEASED, seq))

    state = view.unstage(payload.state) if payload.state is not None else payload.inline_state
    try:
        return writer.write(state, payload.path, release=release, **payload.kwargs)
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
        view = BufferView(buffer_fd)
    except BaseException as exc:
        # The parent is waiting for the handshake; answer it with the reason.
        conn.send(_failure(seq, exc))
        conn.close()
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
                result = _serve_write(conn, writer, view, seq, req.payload)
            except Exception as exc:
                logger.warning("checkpoint write failed: %s", exc)
                conn.send(_failure(seq, exc))
            else:
                conn.send(Response(ResponseKind.DONE, seq, result=result))
                _housekeeping(writer)
        else:
            conn.send(_failure(seq, ValueError(f"unknown request {req.kind!r}")))
