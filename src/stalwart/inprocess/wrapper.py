"""``Wrapper``: the public decorator that restarts a distributed function in-process."""

from __future__ import annotations

import functools
import logging
import warnings
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
            if options.enabled and not logging.getLogger(__package__).hasHandlers():
                # Python's last-resort handler shows warnings only: the restarts
                # (logged at INFO) would leave no trace.  As NVIDIA's wrapper warns.
                warnings.warn(
                    "logging is not configured (no handler on the root logger): the "
                    "in-process restarts will not be logged; call logging.basicConfig()",
                    UserWarning,
                    stacklevel=2,
                )
            if not options.enabled:
                result: R = run_plain(fn, args, dict(kwargs))
                return result
            value: R | None = run_wrapped(options, fn, args, dict(kwargs))
            return value

        return wrapped
