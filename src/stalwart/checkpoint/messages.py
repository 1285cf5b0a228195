"""Messages exchanged between the parent and its writer subprocess.

These travel over a ``multiprocessing`` pipe between a process and the child it
spawned itself, so pickling them is acceptable; nothing else ever reads that
pipe. Tensor data never travels here: a write request only carries the pickled
*skeleton* of the state dict plus offsets into the shared staging buffer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestKind(enum.Enum):
    PING = "ping"
    WRITE = "write"
    EXIT = "exit"


class ResponseKind(enum.Enum):
    PONG = "pong"
    # The writer has stopped reading the staging buffer; the parent may reuse it
    # while the child is still fsyncing and committing.
    RELEASED = "released"
    DONE = "done"
    FAILED = "failed"
    BYE = "bye"


@dataclass(frozen=True)
class StagedState:
    """A state dict whose tensors live in the shared staging buffer."""

    skeleton: bytes
    used_bytes: int
    capacity: int


@dataclass(frozen=True)
class WritePayload:
    path: str
    state: StagedState
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Request:
    kind: RequestKind
    seq: int
    payload: WritePayload | None = None


@dataclass(frozen=True)
class Response:
    kind: ResponseKind
    seq: int
    result: Any = None
    error_message: str = ""
    error_type: str = ""
    error_errno: int | None = None
    traceback: str = ""
