"""Fault injection for users' jobs and for our own tests.

A spec names a fault, the global rank it hits, the step and the attempt::

    crash:rank=1,step=30            SIGSEGV, like a C extension crashing
    exit:rank=0,step=10,code=3      os._exit(code)
    sigkill:rank=1,step=40          SIGKILL to itself
    raise:rank=0,step=20            RuntimeError from the training loop
    hang:rank=1,step=50             sleeps forever (mode=sleep|gil|stop: GIL held in C, SIGSTOP)

Several specs are joined with ``;``.  ``attempt=N`` picks the restart attempt that
faults (default 0, the first; ``attempt=*`` faults on every attempt).  The launcher's
``--inject`` flag puts the spec in ``STALWART_INJECT``; the training loop calls
``stalwart.inject.step(step)`` once per step; the call also reports the step for the
launcher's goodput accounting (``stalwart.progress``).  Without a fault planned it
costs about 0.3 µs under ``stalwart run`` and two attribute checks elsewhere.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from enum import Enum

from stalwart import progress, runlog
from stalwart.base import envvars

ENV_VAR = envvars.INJECT


class FaultKind(Enum):
    CRASH = "crash"
    EXIT = "exit"
    SIGKILL = "sigkill"
    RAISE = "raise"
    HANG = "hang"


class HangMode(Enum):
    SLEEP = "sleep"
    GIL = "gil"
    STOP = "stop"


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault."""


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    rank: int | None  # None: every rank
    step: int
    attempt: int | None = 0  # None: every attempt
    code: int = 1
    mode: HangMode = HangMode.SLEEP
    text: str = field(default="", compare=False)  # the spec as written, for messages

    def matches(self, rank: int, step: int, attempt: int) -> bool:
        return (
            step == self.step
            and (self.rank is None or self.rank == rank)
            and (self.attempt is None or self.attempt == attempt)
        )


_KEYS = {"rank", "step", "attempt", "code", "mode"}


def _int(spec: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"bad --inject spec {spec!r}: {key}={value!r} is not an integer") from None


def parse_one(spec: str) -> Fault:
    kind_s, _, rest = spec.strip().partition(":")
    try:
        kind = FaultKind(kind_s.strip())
    except ValueError:
        kinds = "|".join(k.value for k in FaultKind)
        raise ValueError(
            f"bad --inject spec {spec!r}: unknown fault {kind_s!r}, expected {kinds}"
        ) from None
    fields: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in _KEYS:
            raise ValueError(
                f"bad --inject spec {spec!r}: {item!r} is not one of {sorted(_KEYS)} as key=value"
            )
        fields[key] = value.strip()
    if "step" not in fields:
        raise ValueError(f"bad --inject spec {spec!r}: step=N is required")
    rank = None if fields.get("rank", "*") == "*" else _int(spec, "rank", fields["rank"])
    attempt_s = fields.get("attempt", "0")
    attempt = None if attempt_s == "*" else _int(spec, "attempt", attempt_s)
    try:
        mode = HangMode(fields.get("mode", "sleep"))
    except ValueError:
        raise ValueError(f"bad --inject spec {spec!r}: mode must be sleep|gil|stop") from None
    step = _int(spec, "step", fields["step"])
    if step < 0 or (rank is not None and rank < 0) or (attempt is not None and attempt < 0):
        raise ValueError(f"bad --inject spec {spec!r}: rank, step and attempt must be >= 0")
    code = _int(spec, "code", fields.get("code", "1"))
    return Fault(kind, rank, step, attempt, code, mode, text=spec.strip())


def parse(specs: str) -> list[Fault]:
    """Parses ``spec;spec;...``; raises ValueError naming the bad part."""
    return [parse_one(s) for s in specs.split(";") if s.strip()]


def trigger(fault: Fault) -> None:
    """Performs *fault* in this process now."""
    sys.stdout.flush()
    sys.stderr.flush()
    if fault.kind is FaultKind.RAISE:
        raise InjectedFault(f"injected fault at step {fault.step}")
    if fault.kind is FaultKind.EXIT:
        os._exit(fault.code)
    if fault.kind is FaultKind.SIGKILL:
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind is FaultKind.CRASH:
        # Restore the default action so Python's own handlers cannot soften the crash.
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault.kind is FaultKind.HANG:
        if fault.mode is HangMode.STOP:
            os.kill(os.getpid(), signal.SIGSTOP)
        if fault.mode is HangMode.GIL:
            # PyDLL keeps the GIL across the call: the interpreter is stuck in C.
            libc = ctypes.PyDLL(None)
            while True:
                libc.sleep(3600)
        while True:
            time.sleep(3600)


class _Injector:
    """Holds the parsed faults of this process; built once from the environment."""

    def __init__(self) -> None:
        spec = os.environ.get(ENV_VAR, "")
        self.faults = parse(spec) if spec else []
        self.rank = int(os.environ.get(envvars.RANK, "0"))
        self.attempt = int(os.environ.get(envvars.RESTART_COUNT, "0"))

    def step(self, step: int) -> None:
        for fault in self.faults:
            if fault.matches(self.rank, step, self.attempt):
                # Recorded first: once the fault acts, this process may say nothing more.
                runlog.emit(runlog.FAULT_INJECTED, fault=fault.text, step=step)
                trigger(fault)


# One per process: the environment it reads is fixed for the life of a worker.
_injector: _Injector | None = None


def step(step: int) -> None:
    """Call once per training step; performs any fault scheduled for this rank and step."""
    progress.report(step)
    at(step)


def at(step: int) -> None:
    """Performs any fault planned for *step* without reporting the step (the automatic
    step signal of `stalwart.autostep` reports it its own way)."""
    global _injector
    if _injector is None:
        _injector = _Injector()
    if _injector.faults:
        _injector.step(step)


def reset() -> None:
    """Forget the cached spec (for in-process restarts that change RANK, and tests)."""
    global _injector
    _injector = None
    progress.reset()
