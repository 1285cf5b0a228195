"""Fixtures for every test folder; the helpers themselves are in ``tests/helpers.py``."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests import helpers


@pytest.fixture(autouse=True)
def _no_launcher_outlives_its_test() -> Iterator[None]:
    """A launcher a failed test left running (a wait that timed out) is SIGKILLed, so it
    cannot hold its workers and ports through the rest of the run."""
    yield
    while helpers.STARTED:
        proc = helpers.STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture(params=["warm", "cold"])
def start_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Asked for by ``helpers.warm_and_cold``: the test runs once per start path."""
    helpers.START["warm"] = request.param == "warm"
    try:
        yield request.param
    finally:
        helpers.START["warm"] = True


@pytest.fixture
def cold_start() -> Iterator[None]:
    """Asked for by ``helpers.cold_only``: warm starts off for this test."""
    helpers.START["warm"] = False
    try:
        yield
    finally:
        helpers.START["warm"] = True
