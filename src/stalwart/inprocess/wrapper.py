"""``Wrapper``: the public decorator that restarts a distributed function in-process."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from .options import Options
from .runner import run_plain, run_wrapped

P = ParamSpec("P")
R = TypeVar("R")


class Wrapper(Options):
    """Decorator: on a fault on any rank, all healthy ranks re-enter the function together.

    Takes the keywords of ``Options`` (declared there once).  Durations are seconds or
    ``timedelta``.  Hooks have NVIDIA ``inprocess``'s shapes (see ``hooks.py``).  See
    docs/inprocess.md for each option.  The wrapped function returns its value on active
    ranks and ``None`` on spares.
    """

    @property
    def options(self) -> Options:
        return self

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R | None]:
        options = self.options

        @functools.wraps(fn)
        def wrapped(*args: P.args, **kwargs: P.kwargs) -> R | None:
            if not options.enabled:
                result: R = run_plain(fn, args, dict(kwargs))
                return result
            value: R | None = run_wrapped(options, fn, args, dict(kwargs))
            return value

        return wrapped
