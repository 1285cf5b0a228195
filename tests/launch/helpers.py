"""What only the launcher tests use; the helpers every folder shares are in
``tests/helpers.py``."""

from __future__ import annotations

from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"
