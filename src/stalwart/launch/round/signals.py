"""Termination signals that arrive before the supervisor is ready for them.

``stalwart run`` spends its first second importing (torch among others) and starting
helpers.  A SIGINT there used to end it with a ``KeyboardInterrupt`` traceback, a
SIGTERM with no shutdown events at all.  ``hold`` is the first thing ``main`` does: it
only records such signals; the supervisor, once its own handlers are in place, takes
the first recorded one as if it had just arrived and shuts down the usual way.
Standard library only, so that holding costs nothing before the imports it covers.
"""

from __future__ import annotations

import signal
from types import FrameType

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

_pending: list[int] = []


def _record(signum: int, frame: FrameType | None) -> None:
    _pending.append(signum)


def hold() -> None:
    """Records termination signals instead of acting on them (see the module doc)."""
    for sig in FORWARDED:
        signal.signal(sig, _record)


def pending() -> int | None:
    """The first signal held, if any (it stays pending until ``clear``)."""
    return _pending[0] if _pending else None


def clear() -> None:
    _pending.clear()
