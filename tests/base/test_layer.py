"""The base layer stands below every package: importing it loads nothing else of stalwart
and no third-party module (the in-process reaper and bootstrap start on it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import stalwart.base

MODULES = sorted(
    f"stalwart.base.{p.stem}"
    for p in Path(stalwart.base.__file__).parent.glob("*.py")
    if p.stem != "__init__"
)


@pytest.mark.timeout(60)
def test_base_imports_only_itself_and_the_standard_library() -> None:
    code = (
        "import sys, json\n"
        "before = set(sys.modules)\n"
        f"for m in {MODULES!r}: __import__(m)\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    loaded = json.loads(out)
    ours = [m for m in loaded if m.startswith("stalwart")]
    assert ours and all(m == "stalwart" or m.startswith("stalwart.base") for m in ours), ours
    stdlib = sys.stdlib_module_names
    foreign = [
        m for m in loaded if not m.startswith(("stalwart", "_")) and m.split(".")[0] not in stdlib
    ]
    assert not foreign, foreign
