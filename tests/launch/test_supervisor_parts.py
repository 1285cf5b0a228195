"""The supervisor's parts, each on its own: the signal gate (a decision: table, no
process), the round's resources (one ordered close that survives a failing step), the
attempt's bookkeeping and the job's ending, with fakes only where a part would start a
process."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from stalwart.base.events import Event
from stalwart.config import LaunchConfig
from stalwart.launch.files.events import EventLog
from stalwart.launch.files.logs import LogSpec
from stalwart.launch.round import signals
from stalwart.launch.round.attempt import AttemptWorkers
from stalwart.launch.round.decide import Ending, JobOver, State, Stop, interrupted
from stalwart.launch.round.ending import JobEnding
from stalwart.launch.round.records import SignalReceived
from stalwart.launch.round.resources import RoundResources
from stalwart.launch.round.signal_gate import SignalGate
from stalwart.monitor import MonitorConfig
from tests.helpers import read_events

pytestmark = pytest.mark.timeout(30)


def config(tmp_path: Path) -> LaunchConfig:
    return LaunchConfig(
        entrypoint="train.py", log_dir=tmp_path, run_id="parts", monitor=MonitorConfig()
    )


# -- the signal gate -----------------------------------------------------------------------
@dataclass
class Seconds:
    calls: int = 0

    def __call__(self) -> None:
        self.calls += 1


def test_first_signal_raises_and_a_swallowed_one_is_raised_again() -> None:
    gate = SignalGate(Seconds())
    with pytest.raises(SignalReceived) as got:
        gate.on_signal(signal.SIGTERM, None)
    assert got.value.sig == signal.SIGTERM
    # Something caught and dropped it: the round loop raises it again.
    with pytest.raises(SignalReceived):
        gate.raise_swallowed()


def test_signals_while_starting_wait_for_the_block_and_the_first_wins() -> None:
    gate = SignalGate(Seconds())
    with pytest.raises(SignalReceived) as got, gate.deferred():
        gate.on_signal(signal.SIGINT, None)  # returns: workers are being started
        gate.on_signal(signal.SIGTERM, None)
    assert got.value.sig == signal.SIGINT
    with gate.deferred():  # a later block starts clean
        pass


def test_a_second_signal_while_stopping_ends_the_grace_instead_of_raising() -> None:
    second = Seconds()
    gate = SignalGate(second)
    gate.begin_stopping()
    gate.on_signal(signal.SIGTERM, None)
    gate.on_signal(signal.SIGINT, None)
    assert second.calls == 2 and gate.stopping
    gate.raise_swallowed()  # stopping: nothing to re-raise


@pytest.fixture
def handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (*signals.FORWARDED, signal.SIGUSR1)}
    try:
        yield
    finally:
        signals.clear()
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.usefixtures("handlers")
def test_install_takes_a_held_signal_and_restore_puts_the_old_handlers_back() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    signals.hold()
    os.kill(os.getpid(), signal.SIGHUP)  # arrives before the supervisor is ready
    gate = SignalGate(Seconds())
    with pytest.raises(SignalReceived) as got:
        gate.install(["SIGUSR1"])
    assert got.value.sig == signal.SIGHUP and signals.pending() is None
    with pytest.raises(SignalReceived) as real:
        os.kill(os.getpid(), signal.SIGUSR1)  # asked for: handled, a real delivery
        signal.sigtimedwait([], 0)  # a bytecode boundary for the handler
    assert real.value.sig == signal.SIGUSR1
    gate.restore()
    assert signal.getsignal(signal.SIGUSR1) == before


# -- the round's resources -----------------------------------------------------------------
@dataclass
class Closing:
    """Stands in for a resource that would start a process; records what was closed."""

    name: str
    log: list[str]
    fails: bool = False
    pid: int = 4242

    def _record(self, what: str) -> None:
        self.log.append(f"{self.name}.{what}")
        if self.fails:
            raise OSError(f"{self.name} is gone")

    def leave(self) -> None:
        self._record("leave")

    def close(self, linger: bool = False) -> None:
        self._record("close")

    def stop(self) -> None:
        self._record("stop")

    def stop_learning(self) -> None:
        self._record("stop_learning")

    def owned_pids(self) -> set[int]:
        return {self.pid}

    @property
    def proc(self) -> Closing:
        return self


def test_close_of_nothing_made_is_quiet(tmp_path: Path) -> None:
    res = RoundResources(config(tmp_path), lambda *a, **k: None, None)
    res.quiesce()
    res.close()
    assert res.keep_pids() == set()


def test_close_runs_every_step_in_order_past_a_failing_one(tmp_path: Path) -> None:
    log: list[str] = []
    res = RoundResources(config(tmp_path), lambda *a, **k: None, None)
    res.rdzv = Closing("rdzv", log, fails=True)  # type: ignore[assignment]
    for name in ("progress", "hangs", "warm", "replicas", "snapshots", "guardian"):
        setattr(res, name, Closing(name, log, pid=len(log) + 7))
    res.quiesce()
    with pytest.raises(OSError, match="rdzv is gone"):
        res.close()
    assert log == [
        "warm.stop_learning",
        "rdzv.leave",
        "progress.close",
        "hangs.stop",
        "warm.close",
        "replicas.close",
        "snapshots.close",
        "guardian.close",
    ]
    assert res.keep_pids() == {7}


# -- the attempt -----------------------------------------------------------------------------
@dataclass
class Exited:
    """A process context's exit table as the round loop reads it."""

    table: dict[int, tuple[int, int, int | None, float]] = field(default_factory=dict)

    def exit_info(self) -> dict[int, tuple[int, int, int | None, float]]:
        return self.table


def attempt_for(tmp_path: Path, log: EventLog) -> tuple[AttemptWorkers, SignalGate]:
    cfg = config(tmp_path)
    gate = SignalGate(Seconds())
    res = RoundResources(cfg, log.emit, tmp_path)
    return AttemptWorkers(cfg, res, gate, log.emit, log.path, LogSpec(tmp_path)), gate


def test_each_exit_is_written_once_and_only_when_seen(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl", run_id="parts")
    attempt, gate = attempt_for(tmp_path, log)
    ctx = Exited({0: (0, 100, None, 0.0), 1: (1, 101, -9, 1.5)})
    attempt.emit_exits(ctx, 0, exited_only=True)  # type: ignore[arg-type]
    attempt.emit_exits(ctx, 0, exited_only=True)  # type: ignore[arg-type]
    ctx.table[0] = (0, 100, 0, 2.0)
    attempt.emit_exits(ctx, 0)  # type: ignore[arg-type]
    log.close()
    exits = [e for e in read_events(log.path) if e["event"] == Event.WORKER_EXIT]  # type: ignore[arg-type]
    assert [(e["local_rank"], e["exitcode"], e["signal"]) for e in exits] == [
        (1, -9, "SIGKILL"),
        (0, 0, None),
    ]
    attempt.stop()  # no workers: still marks the job as stopping
    assert gate.stopping and attempt.ctx is None


def test_empty_stack_files_are_dropped_and_written_ones_kept(tmp_path: Path) -> None:
    log = EventLog(None, run_id="parts")
    attempt, _ = attempt_for(tmp_path, log)
    empty, written = tmp_path / "a" / "stacks.log", tmp_path / "b" / "stacks.log"
    for path in (empty, written):
        path.parent.mkdir()
        path.touch()
    written.write_text("Thread 1 (most recent call first)\n")
    attempt._stacks = [empty, written, tmp_path / "never" / "stacks.log"]
    attempt.drop_empty_stacks()
    assert not empty.exists() and written.exists()


# -- the ending ------------------------------------------------------------------------------
@dataclass
class Told:
    finished: list[tuple[bool, str, int | None]] = field(default_factory=list)

    def finish(self, succeeded: bool, reason: str, exit_code: int | None = None) -> None:
        self.finished.append((succeeded, reason, exit_code))


def ending_for(tmp_path: Path, told: Told | None) -> tuple[JobEnding, EventLog]:
    log = EventLog(tmp_path / "events.jsonl", run_id="parts")
    return JobEnding(config(tmp_path), log, tmp_path, lambda: told, set()), log  # type: ignore[arg-type,return-value]


def test_stop_makes_and_keeps_the_result_and_tells_the_other_nodes(tmp_path: Path) -> None:
    told = Told()
    ending, log = ending_for(tmp_path, told)
    move = Stop(Ending.SUCCEEDED, State.SUCCEEDED, 0, 2, tell=JobOver(True, "done"))
    result = ending.stop(move)
    assert ending.result is result and (result.exit_code, result.attempts) == (0, 2)
    assert told.finished == [(True, "done", None)]
    ending.write_exit()
    log.close()
    kinds = [e["event"] for e in read_events(tmp_path / "events.jsonl")]
    assert kinds == [Event.JOB_SUCCEEDED, Event.LAUNCHER_EXIT]


@pytest.mark.parametrize(
    ("rdzv_failed", "code"),
    [(False, 1), (True, 3)],
)
def test_exit_code_without_a_result(tmp_path: Path, rdzv_failed: bool, code: int) -> None:
    ending, log = ending_for(tmp_path, None)
    ending.rdzv_failed = rdzv_failed
    ending.write_exit()
    log.close()
    (exit_event,) = read_events(tmp_path / "events.jsonl")
    assert exit_event["exit_code"] == code


def test_hostile_event_log_still_gets_its_exit_line(tmp_path: Path) -> None:
    """The closing block reads events.jsonl back; lines a worker (or anyone who can write
    the run folder) appended, oversized or not JSON, never cost the launcher_exit line."""
    ending, log = ending_for(tmp_path, Told())
    ending.stop(interrupted(signal.SIGTERM, 0))
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write("{not json\n" + json.dumps({"event": "progress", "step": "x" * 5_000_000}) + "\n")
        f.write(json.dumps({"event": Event.PROGRESS, "attempt": [], "rank": {}}) + "\n")
    ending.write_exit()
    log.close()
    last = (tmp_path / "events.jsonl").read_bytes().splitlines()[-1]
    record: dict[str, Any] = json.loads(last)
    assert record["event"] == Event.LAUNCHER_EXIT and record["exit_code"] == 128 + signal.SIGTERM
