"""The supervisor's round loop as a table: a real ``Supervisor`` over a fake rendezvous
whose rounds end as each row says, without a worker process (join -> run the round ->
decide -> act, and what the job's end says to the other nodes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from stalwart.config import LaunchConfig
from stalwart.launch.round.decide import RoundOutcome
from stalwart.launch.round.supervisor import Supervisor
from stalwart.launch.workers.processes import RunResult
from stalwart.monitor import MonitorConfig
from stalwart.rendezvous.api import (
    FailureRecord,
    JobEnded,
    NodeLost,
    RendezvousInfo,
    ShutdownRequested,
    WorkerFailed,
)
from tests.helpers import read_events

pytestmark = pytest.mark.timeout(60)


def fails(message: str = "ValueError: config key 'lr' missing", rank: int = 1) -> WorkerFailed:
    return WorkerFailed(node_rank=0, local_rank=rank, rank=rank, exitcode=1, message=message)


@dataclass(frozen=True)
class Round:
    """How one round ends: the outcome on this node, what every node reported, and the
    furthest step a local rank reached in it."""

    outcome: RoundOutcome
    records: tuple[FailureRecord, ...] = ()
    step: int | None = None


OK = Round(RoundOutcome.SUCCEEDED)
CRASH = Round(RoundOutcome.LOCAL_FAILURE, (fails(),))
PEER = Round(RoundOutcome.PEER_FAILURE, (fails(),))


def crash_at(step: int) -> Round:
    return Round(RoundOutcome.LOCAL_FAILURE, (fails("RuntimeError: bad batch"),), step)


@dataclass
class FakeRendezvous:
    """The rendezvous contract, in memory: rounds close at once; a scripted job end
    (a peer that stopped the job) is raised at the join of the round it names."""

    ended_at: dict[int, JobEnded] = field(default_factory=dict)
    records: dict[int, tuple[FailureRecord, ...]] = field(default_factory=dict)
    finished: list[tuple[bool, str, int | None]] = field(default_factory=list)
    reported: list[FailureRecord] = field(default_factory=list)
    run_id: str = "table"
    node_rank: int | None = 0
    elastic: bool = False
    left: bool = False

    def join(self, round_: int, local_world_size: int) -> RendezvousInfo:
        if round_ in self.ended_at:
            raise self.ended_at[round_]
        return RendezvousInfo(round_, 0, 1, 0, local_world_size, "127.0.0.1", 1, 0.0)

    def report_failure(self, round_: int, failure: FailureRecord) -> None:
        self.reported.append(failure)

    def failed(self, round_: int) -> bool:
        return bool(self.records.get(round_))

    def failures(self, round_: int) -> list[FailureRecord]:
        return list(self.records.get(round_, ()))

    def waiting(self, round_: int) -> int:
        return 0

    def report_done(self, round_: int) -> None:
        pass

    def all_done(self, round_: int) -> bool:
        return True

    def finish(self, succeeded: bool, reason: str, exit_code: int | None = None) -> None:
        self.finished.append((succeeded, reason, exit_code))

    def interrupt(self) -> None:
        pass

    def leave(self) -> None:
        self.left = True


class TableSupervisor(Supervisor):
    """A real supervisor whose rounds are the table's: no guardian, template, monitor or
    worker is started (``_set_up``), and a round ends as its row says (``_run_round``)."""

    def __init__(self, cfg: LaunchConfig, rdzv: FakeRendezvous, rounds: list[Round]) -> None:
        super().__init__(cfg, rendezvous=rdzv)  # type: ignore[arg-type]
        self.fake = rdzv
        self.rounds = rounds

    def _set_up(self) -> FakeRendezvous:  # type: ignore[override]
        return self.fake

    def _run_round(  # type: ignore[override]
        self, rdzv: FakeRendezvous, info: RendezvousInfo
    ) -> tuple[RoundOutcome, RunResult | None]:
        row = self.rounds[info.round]
        rdzv.records[info.round] = row.records
        self._attempt.furthest_step = row.step
        return row.outcome, None


LOOP_LINE = "crash loop: rank 1 \"ValueError: config key 'lr' missing\" ended 3 attempts"


@pytest.mark.parametrize(
    ("rounds", "flags", "ended_at", "code", "kinds", "told"),
    [
        pytest.param([OK], {}, {}, 0, ["job_succeeded"], (True, None), id="success"),
        pytest.param(
            [CRASH] * 6,
            {"max_restarts": 5},
            {},
            93,
            ["restart", "restart", "job_failed"],
            (False, 93),
            id="crash-loop-stopped-after-3",
        ),
        pytest.param(
            [PEER] * 6,
            {"max_restarts": 5},
            {},
            93,
            ["restart", "restart", "job_failed"],
            (False, 93),
            id="a-peers-crash-loop-seen-from-here",
        ),
        pytest.param(
            [CRASH] * 6,
            {"max_restarts": 5, "max_no_progress_attempts": 0},
            {},
            1,
            ["restart"] * 5 + ["job_failed"],
            (False, None),
            id="verdict-off",
        ),
        pytest.param(
            [crash_at(4), crash_at(9), crash_at(14), OK],
            {"max_restarts": 5},
            {},
            0,
            ["restart", "restart", "restart", "job_succeeded"],
            (True, None),
            id="same-fault-while-progressing-runs-on",
        ),
        pytest.param(
            [crash_at(4), crash_at(3), crash_at(4), crash_at(2)],
            {"max_restarts": 5},
            {},
            93,
            ["restart", "restart", "restart", "job_failed"],
            (False, 93),
            id="progress-then-stuck",
        ),
        pytest.param(
            [Round(RoundOutcome.PEER_FAILURE, (fails(), NodeLost(node_rank=1)))] * 4,
            {"max_restarts": 3},
            {},
            1,
            ["restart", "restart", "restart", "job_failed"],
            (False, None),
            id="lost-nodes-never-a-loop",
        ),
        pytest.param(
            [Round(RoundOutcome.LOCAL_FAILURE, (fails("ModuleNotFoundError: No module 'x'"),))],
            {"max_restarts": 5, "stop_on": ("ImportError",)},
            {},
            93,
            ["job_failed"],
            (False, 93),
            id="stop-on-at-once",
        ),
        pytest.param(
            [CRASH, CRASH],
            {"max_restarts": 1},
            {},
            1,
            ["restart", "job_failed"],
            (False, None),
            id="budget-spent-first",
        ),
        pytest.param(
            [PEER, OK],
            {"max_restarts": 5},
            {1: JobEnded(False, "crash loop: rank 1 ... (exit code 93: do not requeue)", 93)},
            93,
            ["restart", "job_ended_without_this_node"],
            None,
            id="told-by-the-node-that-stopped",
        ),
        pytest.param(
            [Round(RoundOutcome.PEER_FAILURE, (ShutdownRequested(node_rank=1, reason="stop"),))],
            {"max_restarts": 5},
            {},
            1,
            ["job_stopped"],
            (False, None),
            id="shutdown-asked-by-a-peer",
        ),
    ],
)
def test_round_loop(
    tmp_path: Path,
    rounds: list[Round],
    flags: dict[str, object],
    ended_at: dict[int, JobEnded],
    code: int,
    kinds: list[str],
    told: tuple[bool, int | None] | None,
) -> None:
    cfg = LaunchConfig(
        entrypoint="train.py", log_dir=tmp_path, run_id="table", monitor=MonitorConfig(), **flags
    )  # type: ignore[arg-type]
    rdzv = FakeRendezvous(ended_at=dict(ended_at))
    result = TableSupervisor(cfg, rdzv, rounds).run()
    assert result.exit_code == code
    evs = read_events(tmp_path / "table" / "events.jsonl")
    acted = [
        e["event"]
        for e in evs
        if e["event"]
        in {"restart", "job_failed", "job_succeeded", "job_stopped", "job_ended_without_this_node"}
    ]
    assert acted == kinds
    assert evs[-1]["event"] == "launcher_exit" and evs[-1]["exit_code"] == code
    assert rdzv.left
    if told is None:
        assert rdzv.finished == []
    else:
        assert [(s, c) for s, _, c in rdzv.finished] == [told]
    if code == 93 and told is not None:
        (failed,) = [e for e in evs if e["event"] == "job_failed"]
        assert "do not requeue" in failed["verdict"]
        assert rdzv.finished[0][1] == failed["verdict"]
        if "stop_on" not in flags:
            assert failed["verdict"].startswith(LOOP_LINE) or "RuntimeError" in failed["verdict"]
