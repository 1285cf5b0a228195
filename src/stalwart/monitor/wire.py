"""Messages on the node's named pipe: one JSON object per line, never larger than PIPE_BUF.

Timer requests use torch elastic's FileTimerRequest field names, so torch's
FileTimerClient can talk to stalwart's server through TORCHELASTIC_TIMER_FILE and
stalwart's client can talk to torch's server. Control requests add a "type" field.
Writes of at most PIPE_BUF bytes to a pipe are atomic, which is what keeps lines from
several ranks from interleaving; a longer message is refused before it is written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import select
import signal
from typing import Any

from stalwart.monitor.reports import ControlAction

PIPE_BUF: int = getattr(select, "PIPE_BUF", 4096)
VERSION = 1
MAX_PID = 2**31 - 1  # pid_t; a larger number cannot name a process
#: Signal numbers a timer may name; <= 0 means "observe, never reap" (torch's meaning).
VALID_SIGNALS: frozenset[int] = frozenset(int(s) for s in signal.valid_signals())


def check_signal(sig: int) -> int:
    """`sig` if a timer may carry it (<= 0, or a real signal); ValueError naming it otherwise."""
    if isinstance(sig, bool) or not isinstance(sig, int):
        raise ValueError(f"timer signal must be an integer, got {sig!r}")
    if sig > 0 and sig not in VALID_SIGNALS:
        raise ValueError(
            f"timer signal {sig} is not a signal of this system "
            f"(expected 1..{max(VALID_SIGNALS)}, or <= 0 to only observe)"
        )
    return sig


class MessageTooLarge(ValueError):
    """The encoded line would not fit one atomic pipe write."""


class BadMessage(ValueError):
    """A line that is not a well-formed request; the server logs and drops it."""


@dataclasses.dataclass(frozen=True)
class TimerMessage:
    """Acquire (expiration_time >= 0, wall clock) or release (expiration_time < 0)."""

    pid: int
    scope_id: str
    expiration_time: float
    signal: int

    @property
    def is_release(self) -> bool:
        return self.expiration_time < 0


@dataclasses.dataclass(frozen=True)
class ControlMessage:
    pid: int
    global_rank: int | None
    action: ControlAction


Message = TimerMessage | ControlMessage


def encode(msg: Message) -> bytes:
    body: dict[str, Any]
    if isinstance(msg, TimerMessage):
        body = {
            "version": VERSION,
            "pid": msg.pid,
            "scope_id": msg.scope_id,
            "expiration_time": msg.expiration_time,
            "signal": msg.signal,
        }
    else:
        body = {
            "version": VERSION,
            "type": "control",
            "pid": msg.pid,
            "global_rank": msg.global_rank,
            "action": msg.action.value,
        }
    line = json.dumps(body, separators=(",", ":")).encode() + b"\n"
    if len(line) > PIPE_BUF:
        raise MessageTooLarge(
            f"monitor request is {len(line)} bytes, more than PIPE_BUF ({PIPE_BUF}); "
            "use a shorter scope name"
        )
    return line


def _int(body: dict[str, Any], key: str) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadMessage(f"field {key!r} must be an integer, got {value!r}")
    return value


def decode(line: bytes) -> Message:
    """Parses one line (without its newline); raises BadMessage on anything unexpected."""
    try:
        # RecursionError: a deeply nested line exhausts the parser's recursion limit.
        body = json.loads(line)
    except RecursionError:
        raise BadMessage("not JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadMessage(f"not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadMessage("not a JSON object")
    if body.get("version") != VERSION:
        raise BadMessage(f"unsupported version {body.get('version')!r}")
    pid = _int(body, "pid")
    if not 0 < pid <= MAX_PID:
        raise BadMessage(f"bad pid {pid}")
    if body.get("type", "timer") == "control":
        rank = body.get("global_rank")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise BadMessage(f"bad global_rank {rank!r}")
        try:
            action = ControlAction(body.get("action"))
        except ValueError:
            raise BadMessage(f"unknown control action {body.get('action')!r}") from None
        return ControlMessage(pid=pid, global_rank=rank, action=action)
    if body.get("type", "timer") != "timer":
        raise BadMessage(f"unknown message type {body.get('type')!r}")
    scope = body.get("scope_id")
    if not isinstance(scope, str):
        raise BadMessage(f"scope_id must be a string, got {scope!r}")
    expiry = body.get("expiration_time")
    if isinstance(expiry, bool) or not isinstance(expiry, int | float) or not math.isfinite(expiry):
        raise BadMessage(f"bad expiration_time {expiry!r}")
    sig = _int(body, "signal")
    return TimerMessage(pid=pid, scope_id=scope, expiration_time=float(expiry), signal=sig)
