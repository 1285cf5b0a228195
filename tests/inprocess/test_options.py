"""The wrapper's options are declared once (``Options``) and ``Wrapper`` takes exactly them."""

from __future__ import annotations

import dataclasses
import datetime
import inspect

import pytest

from stalwart.inprocess import ShiftRanks, Wrapper
from stalwart.inprocess.errors import ConfigError
from stalwart.inprocess.options import Options


def test_wrapper_takes_exactly_the_declared_options_by_keyword() -> None:
    params = inspect.signature(Wrapper).parameters
    assert list(params) == [f.name for f in dataclasses.fields(Options)]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    with pytest.raises(TypeError):
        Wrapper(None)  # type: ignore[misc]


def test_durations_are_seconds_whatever_the_way_they_are_set() -> None:
    w = Wrapper(last_call_wait=datetime.timedelta(milliseconds=250), termination_grace_time=2)
    assert w.last_call_wait == 0.25 and isinstance(w.termination_grace_time, float)
    w.last_call_wait = datetime.timedelta(seconds=2)
    assert w.last_call_wait == 2.0
    with pytest.raises(ConfigError, match="last_call_wait must be > 0"):
        w.last_call_wait = 0
    assert Wrapper().soft_timeout == 60.0


def test_none_means_the_default_as_in_nvidias_wrapper() -> None:
    w = Wrapper(store_kwargs=None, rank_assignment=None)  # type: ignore[arg-type]
    assert w.store_kwargs is None
    assert isinstance(w.rank_assignment, ShiftRanks)
