"""Programs that never import stalwart, under ``stalwart run`` with no timeout configured:
each optimizer step is a step for stalwart (goodput, ``--inject``, hang detection), a
rank that stops making progress is found from the learned rhythm, killed only on
evidence, and blamed on its stack (issue 22, items 1-3).

The job (``bench/plain_ddp_job.py``, shared with the benchmark) has no ``__main__`` guard and no stalwart
import; its faults are its own code (a sleep before the step's collective, SIGSTOP to
itself, a Dataset that blocks), chosen by PJ_* variables the launcher knows nothing of.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, clean_env, events, stalwart_argv

JOB = ROOT / "bench" / "plain_ddp_job.py"
STEPS = 45

pytestmark = pytest.mark.timeout(150)


def run(
    work: Path, *flags: str, fault: str = "none:0:0", steps: int = STEPS, **pj: str
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]], list[dict[str, Any]]]:
    env = clean_env(PJ_WORK=str(work), PJ_FAULT=fault, PJ_STEPS=str(steps), **pj)
    proc = subprocess.run(
        stalwart_argv(
            "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", work / "logs",
            *flags, JOB,
        ),
        capture_output=True, text=True, timeout=140, env=env, cwd=ROOT,
    )  # fmt: skip
    p = work / "p.jsonl"
    recs = [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []
    return proc, recs, events(work / "logs")


def check_blamed_and_resumed(
    proc: subprocess.CompletedProcess[str],
    recs: list[dict[str, Any]],
    evs: list[dict[str, Any]],
    why: str,
) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]
    hangs = [e for e in evs if e["event"] == "hang_detected"]
    roots = [h for h in hangs if h["waiting_on"] is None]
    assert [h["global_rank"] for h in roots] == [1], hangs
    assert why in roots[0]["evidence"], roots[0]
    for victim in (h for h in hangs if h["global_rank"] == 0):
        assert victim["waiting_on"] == 1 and "waiting on peers" in victim["evidence"], victim
    restart = next(e for e in evs if e["event"] == "restart")
    assert restart["root_cause"]["rank"] == 1, restart
    # The summary names the same rank and why.
    assert "rank 1" in proc.stderr and why in proc.stderr, proc.stderr[-3000:]
    assert [r["attempt"] for r in recs if r["event"] == "start"] == [0, 1]
    assert (recs[-1]["attempt"], recs[-1]["step"]) == (1, STEPS), recs[-1]
    dossier = Path(roots[0]["dossier"]).read_text()
    assert "HUNG" in dossier and why in dossier


@pytest.mark.parametrize(
    ("fault", "why"),
    [
        ("sleep:1:30", "not waiting on peers"),
        ("stop:1:30", "stopped"),
        ("loader:1:27", "__getitem__"),
    ],
)
def test_plain_ddp_hang_is_found_blamed_and_resumed_without_any_timeout(
    tmp_path: Path, fault: str, why: str
) -> None:
    proc, recs, evs = run(tmp_path, fault=fault)
    check_blamed_and_resumed(proc, recs, evs, why)
    started = next(e for e in evs if e["event"] == "monitor_started")
    assert started["config"]["hb_timeout"] is None  # nothing configured


# Four runs: the rule once blamed the wrong rank 3 of 3 times.  The long count (16 of
# 16 right across plain, Lightning and HF jobs) is the benchmark's, where the time it
# costs belongs: bench/bench_progress_hang.py lists the rank blamed in every run ("blamed").
@pytest.mark.parametrize("repeat", range(4))
def test_sleeping_rank_is_blamed_every_time(tmp_path: Path, repeat: int) -> None:
    proc, _recs, evs = run(tmp_path, fault="sleep:1:25", steps=30, PJ_CKPT="5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    roots = [e for e in evs if e["event"] == "hang_detected" and e["waiting_on"] is None]
    assert [h["global_rank"] for h in roots] == [1], roots
    assert next(e for e in evs if e["event"] == "restart")["root_cause"]["rank"] == 1


def test_healthy_run_with_slow_evaluation_and_checkpoints_is_never_killed(tmp_path: Path) -> None:
    # An evaluation pass of 0.5 s (tens of steps long) every 10 steps and a checkpoint
    # every 7: the learned deadline is missed each time; the rank runs code, so no kill.
    proc, recs, evs = run(tmp_path, steps=70, PJ_EVAL="10", PJ_CKPT="7")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [e for e in evs if e["event"] in ("hang_detected", "restart")]
    assert [r["attempt"] for r in recs if r["event"] == "start"] == [0]
    learned = [e for e in evs if e["event"] == "timeouts_learned"]
    assert learned, "the rhythm was never learned"


def test_inject_and_goodput_work_on_a_program_that_never_reports_a_step(tmp_path: Path) -> None:
    proc, _recs, evs = run(tmp_path, "--inject", "crash:rank=1,step=23", PJ_CKPT="10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    injected = [e for e in evs if e["event"] == "fault_injected"]
    assert [(e["rank"], e["step"]) for e in injected] == [(1, 23)], injected
    # Progress counts optimizer steps, resumed from Adam's own count: steps 21-23 redone.
    firsts = [
        e["step"] for e in evs if e["event"] == "progress" and e["attempt"] == 1 and e["rank"] == 0
    ]
    assert firsts and firsts[0] == 21, firsts
    assert "3 step(s) redone" in proc.stderr, proc.stderr[-2000:]


def test_no_auto_progress_switches_the_step_signal_off(tmp_path: Path) -> None:
    proc, recs, evs = run(tmp_path, "--no-auto-progress", fault="none:0:0", steps=10)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [e for e in evs if e["event"] == "progress"]
    assert recs[-1]["step"] == 10


RESTORE_JOB = ROOT / "tests" / "reliability" / "progress_jobs" / "restore_slower_than_a_step.py"


def test_a_restore_longer_than_the_learned_deadline_is_not_a_hang(tmp_path: Path) -> None:
    # A restarted FSDP2 job restores with plain DCP for 6-8 s (its data position
    # replayed), beyond the 5 s deadline a rank has before its rhythm is learned; rank 0
    # finishes first and waits in a collective on rank 1. Neither is a hang: torch's
    # optimizer-state creation inside the restore is no step, and a rank found quiet is
    # judged on a stack dumped in its quiet (it waits on its peers), not one dumped
    # while it worked.
    env = clean_env(RJ_WORK=str(tmp_path), RJ_REPLAY_0="6", RJ_REPLAY_1="8")
    proc = subprocess.run(
        stalwart_argv(
            "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", tmp_path / "logs",
            RESTORE_JOB,
        ),
        capture_output=True, text=True, timeout=140, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    evs = events(tmp_path / "logs")
    assert not [e for e in evs if e["event"] == "hang_detected"], proc.stderr[-3000:]
    assert [e["next_attempt"] for e in evs if e["event"] == "restart"] == [1]
    recs = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["kind"], r.get("step")) for r in recs if r["attempt"] == 1] == [
        ("start", None), ("restored", 2), ("step", 3), ("step", 4),
    ]  # fmt: skip
    # The attempt's steps are counted on from the restored optimizer's own count.
    resumed = [e["step"] for e in evs if e["event"] == "progress" and e["attempt"] == 1]
    assert resumed and min(resumed) == 3, resumed
