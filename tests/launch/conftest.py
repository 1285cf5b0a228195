"""Every launcher test runs twice: workers forked from the warm template, and cold."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from . import helpers


@pytest.fixture(params=["warm", "cold"], autouse=True)
def start_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    helpers.MODE["warm"] = request.param == "warm"
    yield request.param
    helpers.MODE["warm"] = True
