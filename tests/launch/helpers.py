"""What only the launcher tests use; the shared helpers are in ``tests/helpers.py``.

The shared names are re-exported here too, so that tests written against the old home
(``from .helpers import clean_env``) keep working; new tests import ``tests.helpers``.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers import (
    ROOT,
    STALWART,
    alive,
    clean_env,
    events,
    kinds,
    run_dir,
    stalwart,
    start_stalwart,
    wait_for,
)

__all__ = [
    "ROOT",
    "SCRIPTS",
    "STALWART",
    "alive",
    "clean_env",
    "events",
    "kinds",
    "run_dir",
    "stalwart",
    "start_stalwart",
    "wait_for",
]

SCRIPTS = Path(__file__).parent / "scripts"
