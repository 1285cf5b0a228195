"""Pure means pure: the decisions import no monitor code and read no host name, clock or
file; the monitor's requests reach them as plain records."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.launch.round.decide import (
    Asked,
    ControlAsk,
    RoundOutcome,
    control_outcome,
    control_reason,
)
from stalwart.monitor import ControlAction
from tests.helpers import ROOT, clean_env

pytestmark = pytest.mark.timeout(60)

SRC = ROOT / "src" / "stalwart"
PURE = [
    SRC / "launch" / "round" / "decide.py",
    SRC / "launch" / "round" / "restart_policy.py",
    SRC / "rendezvous" / "close_rule.py",
]
# What a pure decision may import: the standard library's plain data and the records it
# is fed.
ALLOWED = {
    "__future__",
    "builtins",
    "collections.abc",
    "dataclasses",
    "enum",
    "re",
    "signal",
    "typing",
    "stalwart.launch.round.restart_policy",
    "stalwart.rendezvous.api",
}
# Calls that read the world: the host, a clock, a file, the environment.
IMPURE = {"gethostname", "getfqdn", "time", "monotonic", "time_ns", "open", "getenv", "environ"}


def test_importing_the_decisions_loads_no_monitor_code() -> None:
    code = (
        "import sys, stalwart.launch.round.decide, stalwart.launch.round.restart_policy;"
        "print(sorted(m for m in sys.modules if m.startswith('stalwart.monitor')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("path", PURE, ids=lambda p: p.name)
def test_a_decision_imports_only_plain_data(path: Path) -> None:
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert imported <= ALLOWED, imported - ALLOWED


@pytest.mark.parametrize("path", PURE, ids=lambda p: p.name)
def test_a_decision_reads_no_host_clock_or_file(path: Path) -> None:
    tree = ast.parse(path.read_text())
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not (names & IMPURE), names & IMPURE


def test_the_supervisor_translates_every_control_action() -> None:
    # The plain enum mirrors the monitor's: a new action there must be named here.
    assert {a.value for a in Asked} == {a.value for a in ControlAction}


@pytest.mark.parametrize(
    ("ask", "outcome", "want"),
    [
        (
            ControlAsk(Asked.SHUTDOWN_WORKLOAD, 3),
            RoundOutcome.SHUTDOWN_REQUESTED,
            "rank 3 asked to shut the workload down",
        ),
        (
            ControlAsk(Asked.EXCLUDE_NODE, None),
            RoundOutcome.NODE_EXCLUDED,
            "rank ? asked to exclude node 2 (host-a)",
        ),
        (
            ControlAsk(Asked.EXCLUDE_NODE, 5, "straggler"),
            RoundOutcome.NODE_EXCLUDED,
            "straggler: excluding node 2 (host-a)",
        ),
        (
            ControlAsk(Asked.EXCLUDE_NODE, 5),
            RoundOutcome.SHUTDOWN_REQUESTED,
            "rank 5 asked to exclude node 2, and a job of fixed membership cannot go on "
            "without it (exclusion needs elastic --nnodes MIN:MAX)",
        ),
    ],
)
def test_control_reason_table(ask: ControlAsk, outcome: RoundOutcome, want: str) -> None:
    assert control_reason(ask, outcome, 2, "host-a") == want
    assert control_outcome(Asked.CONTINUE, True) is None
