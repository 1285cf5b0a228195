"""``--inject`` / ``STALWART_INJECT``: each fault kind does what it says, on the chosen attempt."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart import inject
from tests.helpers import clean_env, events, stalwart, warm_and_cold

from .helpers import SCRIPTS

pytestmark = pytest.mark.timeout(60)


def _exit_of(log_dir: Path, rank: int) -> dict:
    exits = [e for e in events(log_dir) if e["event"] == "worker_exit" and e["rank"] == rank]
    return exits[0]


@warm_and_cold
@pytest.mark.parametrize(
    ("spec", "exitcode", "sig"),
    [
        ("crash:rank=1,step=3", -11, "SIGSEGV"),
        ("exit:rank=1,step=3,code=3", 3, None),
        ("sigkill:rank=1,step=3", -9, "SIGKILL"),
        ("raise:rank=1,step=3", 1, None),
    ],
)
def test_fault_kinds(tmp_path: Path, spec: str, exitcode: int, sig: str | None) -> None:
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "--inject",
        spec,
        "--log-dir",
        tmp_path / "l",
        SCRIPTS / "steps.py",
        tmp_path,
    )
    assert proc.returncode == 1
    ex = _exit_of(tmp_path / "l", 1)
    assert ex["exitcode"] == exitcode and ex["signal"] == sig
    assert (tmp_path / "steps_0_1").read_text().split() == ["0", "1", "2"]
    if spec.startswith("raise"):
        assert "InjectedFault: injected fault at step 3" in proc.stderr


@warm_and_cold
def test_fault_only_on_chosen_attempt_and_from_environment(tmp_path: Path) -> None:
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--log-dir",
        tmp_path / "l",
        SCRIPTS / "steps.py",
        tmp_path,
        "5",
        env=clean_env(STALWART_INJECT="exit:rank=0,step=2,attempt=1;exit:rank=1,step=4"),
    )
    assert proc.returncode == 0, proc.stderr
    restarts = [e for e in events(tmp_path / "l") if e["event"] == "restart"]
    assert [(e["attempt"], e["root_cause"]["rank"]) for e in restarts] == [(0, 1), (1, 0)]
    assert len((tmp_path / "steps_2_0").read_text().split()) == 5  # attempt 2 ran clean


def test_parse_errors_name_the_bad_part() -> None:
    with pytest.raises(ValueError, match=r"rank='x' is not an integer"):
        inject.parse("crash:rank=x,step=1")
    with pytest.raises(ValueError, match="'color=red' is not one of"):
        inject.parse("crash:step=1,color=red")
    with pytest.raises(ValueError, match=r"mode must be sleep\|gil\|stop"):
        inject.parse("hang:step=1,mode=nap")
    faults = inject.parse("hang:rank=*,step=5,attempt=*,mode=stop; exit:step=1,code=9")
    assert faults[0].rank is None and faults[0].attempt is None
    assert faults[0].mode is inject.HangMode.STOP and faults[1].code == 9
