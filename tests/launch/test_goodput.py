"""goodput.account against hand computations of small recorded event streams."""

from __future__ import annotations

from typing import Any

import pytest

from stalwart.reporting.goodput import CATEGORIES, account
from stalwart.reporting.report import summarise
from stalwart.reporting.summary import format_block, never_fired

pytestmark = pytest.mark.timeout(10)


def ev(event: str, time: float, **fields: Any) -> dict[str, Any]:
    return {"event": event, "time": time, **fields}


def wev(event: str, time: float, **fields: Any) -> dict[str, Any]:
    return {"event": event, "time": time, "source": "worker", **fields}


def step(attempt: int, rank: int, s: int, at: float) -> dict[str, Any]:
    return ev("progress", at + 0.05, attempt=attempt, rank=rank, step=s, step_time=at)


CRASH_AND_RESUME = [
    ev("launcher_start", 100.0),
    ev("rendezvous_done", 101.0, attempt=0, world_size=2),
    ev("worker_spawn", 103.0, attempt=0, rank=0),
    ev("worker_spawn", 103.0, attempt=0, rank=1),
    step(0, 0, 0, 104.0),
    step(0, 0, 10, 109.0),
    wev("checkpoint_commit", 109.0, attempt=0, rank=0, step=10),
    step(0, 0, 14, 111.0),
    ev("worker_exit", 111.5, attempt=0, rank=1, exitcode=-11, exited_at=111.4),
    ev("worker_exit", 112.0, attempt=0, rank=0, exitcode=-15, exited_at=111.9),
    ev(
        "restart",
        112.5,
        attempt=0,
        root_cause={"rank": 1, "signal": "SIGSEGV", "exitcode": -11, "timestamp": 111.4},
    ),
    ev("rendezvous_done", 113.0, attempt=1, world_size=2),
    ev("worker_spawn", 114.0, attempt=1, rank=0),
    step(1, 0, 10, 116.0),
    step(1, 0, 19, 120.5),
    ev("worker_exit", 121.5, attempt=1, rank=0, exitcode=0, exited_at=121.2),
    ev("worker_exit", 121.5, attempt=1, rank=1, exitcode=0, exited_at=121.1),
    ev("job_succeeded", 122.0, attempt=1),
    ev("launcher_exit", 122.5, exit_code=0),
]

HANG_THEN_FAIL = [
    ev("launcher_start", 0.0),
    ev("rendezvous_done", 0.5, attempt=0),
    ev("worker_spawn", 1.0, attempt=0, rank=0),
    step(0, 0, 0, 2.0),
    wev("checkpoint_commit", 5.0, attempt=0, rank=0, step=3, stall_s=0.5),
    step(0, 0, 5, 7.0),
    ev("hang_detected", 11.0, attempt=0, global_rank=1, kind="heartbeat", last_heartbeat_age=3.0),
    ev("worker_exit", 11.3, attempt=0, rank=1, exitcode=-15, exited_at=11.2),
    ev(
        "job_failed",
        12.0,
        attempt=0,
        root_cause={"rank": 1, "signal": "SIGTERM", "exitcode": -15, "timestamp": 11.0},
    ),
    ev("launcher_exit", 12.5, exit_code=1),
]

NO_STEPS_SUCCESS = [
    ev("launcher_start", 0.0),
    ev("rendezvous_done", 1.0, attempt=0),
    ev("worker_spawn", 2.0, attempt=0, rank=0),
    ev("worker_exit", 9.1, attempt=0, rank=0, exitcode=0, exited_at=9.0),
    ev("job_succeeded", 9.5, attempt=0),
    ev("launcher_exit", 10.0, exit_code=0),
]

CTRL_C = [
    ev("launcher_start", 0.0),
    ev("worker_spawn", 1.0, attempt=0, rank=0),
    step(0, 0, 0, 1.5),
    ev("shutdown", 5.0, signal="SIGINT"),
    ev("worker_exit", 6.0, attempt=0, rank=0, exitcode=-2, exited_at=5.9),
    ev("job_stopped", 6.2, attempt=0, reason="signal SIGINT"),
    ev("launcher_exit", 6.4, exit_code=130),
]


def zero(**cats: float) -> dict[str, float]:
    out = dict.fromkeys(CATEGORIES, 0.0)
    out.update(cats)
    return out


@pytest.mark.parametrize(
    ("events", "seconds", "wall"),
    [
        (
            CRASH_AND_RESUME,
            # start-up 100->104 and 114->116; recompute 109 (step 10, where attempt 1
            # resumed) -> 111.4 (the crash); restart 112.5->114; the last step ends at
            # 120.5 + 0.5 (mean step), workers exit at 121.2, the job ends at 122.
            zero(
                productive=5.0 + 5.0,
                startup=4.0 + 2.0,
                recompute=2.4,
                detection=0.1,
                teardown=1.0 + 0.2 + 0.5,
                restart=1.5,
                idle=0.8,
            ),
            22.5,
        ),
        (
            # Nobody resumed: the last commit (t=5) bounds the lost work; onset of the
            # hang is its last heartbeat (11 - 3); 0.5 s of the run was a save stall.
            HANG_THEN_FAIL,
            zero(
                productive=2.5,
                startup=2.0,
                checkpoint_stall=0.5,
                recompute=3.0,
                detection=3.0,
                teardown=1.0 + 0.5,
            ),
            12.5,
        ),
        (
            NO_STEPS_SUCCESS,
            zero(startup=2.0, productive=7.0, idle=0.5, teardown=0.5),
            10.0,
        ),
        (CTRL_C, zero(startup=1.5, productive=3.5, teardown=1.2 + 0.2), 6.4),
    ],
    ids=["crash-and-resume", "hang-then-fail", "no-steps", "ctrl-c"],
)
def test_breakdown_equals_hand_computation(
    events: list[dict[str, Any]], seconds: dict[str, float], wall: float
) -> None:
    b = account(events)
    assert b.seconds == pytest.approx(seconds, abs=1e-9)
    assert b.wall == pytest.approx(wall)
    assert sum(b.seconds.values()) == pytest.approx(b.wall)


def test_faults_carry_kind_rank_cost_and_steps_lost() -> None:
    b = account(CRASH_AND_RESUME)
    (f,) = b.faults
    assert (f.attempt, f.kind, f.rank, f.detail) == (0, "crash", 1, "signal SIGSEGV")
    # recompute + detection + teardown + restart + the next attempt's start-up
    assert f.cost == pytest.approx(2.4 + 0.1 + 1.0 + 1.5 + 2.0)
    assert f.steps_lost == 14 - 10 + 1
    assert b.goodput == pytest.approx(10.0 / 22.5)
    (h,) = account(HANG_THEN_FAIL).faults
    assert (h.kind, h.rank, h.at) == ("hang", 1, 8.0)
    assert h.cost == pytest.approx(3.0 + 3.0 + 1.0)


def test_live_run_ends_now() -> None:
    live = CRASH_AND_RESUME[:14]  # attempt 1 running, one progress event in
    b = account(live, now=130.0)
    assert b.end == 130.0
    assert b.attempts[-1].outcome == "running"
    assert b.seconds["productive"] == pytest.approx(5.0 + (130.0 - 116.0))


def test_interpolates_the_resume_step_between_samples() -> None:
    events = [e for e in CRASH_AND_RESUME if not (e["event"] == "progress" and e["step"] == 10)]
    events.insert(4, step(1, 0, 12, 116.0))  # attempt 1 resumed at 12: 0 + 12 * 0.5 s
    events.insert(4, step(0, 0, 0, 104.0))
    b = account(sorted(events, key=lambda e: e["time"]))
    # attempt 0: steps 0 @104 and 14 @111 -> step 12 at 104 + 12 * 0.5 = 110
    assert b.seconds["recompute"] == pytest.approx(111.4 - 110.0)
    assert b.faults[0].steps_lost == 14 - 12 + 1


def test_attempt_duration_leaves_out_the_template_warm_up() -> None:
    events = [
        ev("launcher_start", 0.0),
        ev("rendezvous_done", 0.1, attempt=0, world_size=1),
        ev("template_ready", 5.0),
        ev("worker_spawn", 5.0, attempt=0, rank=0),
        ev("worker_exit", 6.0, attempt=0, rank=0, exitcode=0, exited_at=6.0),
        ev("job_succeeded", 6.0, attempt=0),
    ]
    (row,) = summarise(events)
    assert row["end"] - row["start"] == pytest.approx(1.0)
    assert row["outcome"] == "succeeded"


def test_ctrl_c_attempt_reads_stopped() -> None:
    (row,) = summarise(CTRL_C)
    assert row["outcome"] == "stopped"


def test_summary_block_names_outcome_faults_goodput_and_folder() -> None:
    text = format_block(
        account(CRASH_AND_RESUME), run_id="r1", outcome="succeeded", attempts=2, run_dir="/x/r1"
    )
    assert "job r1 succeeded after 2 attempt(s) in 22.5 s" in text
    assert "fault in attempt 0: rank 1 crash (signal SIGSEGV), cost 7.0 s, 5 step(s) redone" in text
    assert "goodput 44.4% (10.0 s productive;" in text
    assert "run folder: /x/r1" in text


@pytest.mark.parametrize(
    ("spec", "fired", "ranks", "expected"),
    [
        ("crash:rank=1,step=30", [], {0, 1}, ["crash:rank=1,step=30"]),
        ("crash:rank=1,step=30", ["crash:rank=1,step=30"], {0, 1}, []),
        ("crash:rank=5,step=30", [], {0, 1}, []),  # another node's rank
        ("exit:step=3;hang:rank=0,step=9", ["exit:step=3"], {0}, ["hang:rank=0,step=9"]),
        ("", [], {0}, []),
    ],
)
def test_never_fired(spec: str, fired: list[str], ranks: set[int], expected: list[str]) -> None:
    events = [wev("fault_injected", 1.0, fault=f) for f in fired]
    assert never_fired(spec, events, ranks) == expected


LATE_RECORD = [
    ev("rendezvous_done", 11.0, attempt=0, world_size=1),
    ev("worker_spawn", 12.0, attempt=0, rank=0),
    step(0, 0, 0, 13.0),
    ev("worker_exit", 20.0, attempt=0, rank=0, exitcode=0, exited_at=19.5),
    ev("job_succeeded", 20.0, attempt=0),
    ev("launcher_exit", 20.5, exit_code=0),
]


@pytest.mark.parametrize(
    ("process_start", "start"),
    [
        (4.0, 4.0),  # the launcher's process began 6 s before its record: counted
        (10.0, 10.0),
        (10.5, 10.0),  # after its own record: not a start
        (10.0 - 3601, 10.0),  # more than an hour of "start-up": a clock step, ignored
        (-1e300, 10.0),
        (float("nan"), 10.0),
        (True, 10.0),
        ("4.0", 10.0),
        (None, 10.0),
    ],
)
def test_the_run_starts_with_the_launchers_process(process_start: Any, start: float) -> None:
    """Under load a launcher spends seconds (tens) importing and starting its template
    before it writes launcher_start; that wait is start-up, part of the run's wall."""
    events = [ev("launcher_start", 10.0, process_start=process_start), *LATE_RECORD]
    b = account(events)
    assert b.start == start
    assert b.seconds["startup"] == pytest.approx(13.0 - start)
    assert sum(b.seconds.values()) == pytest.approx(b.wall) == pytest.approx(20.5 - start)


@pytest.mark.parametrize("bad", ['"4.0"', "-1", "1e300", "true"])
def test_a_launcher_start_with_a_bad_process_start_is_not_used(bad: str) -> None:
    from stalwart.reporting.event_schema import BadRecord, parse_event_line

    line = f'{{"event":"launcher_start","time":10.0,"process_start":{bad}}}'.encode()
    with pytest.raises(BadRecord, match="process_start"):
        parse_event_line(line)
    assert parse_event_line(b'{"event":"launcher_start","time":10.0,"process_start":4.5}')
