"""Fixtures for every test folder; the helpers themselves are in ``tests/helpers.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import helpers


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
