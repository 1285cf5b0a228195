"""The node monitor's parts on their own: each built with only what it needs, in one
process. Decisions are tables; the parts that act do so on real files, real processes
(a `sleep` child) and an in-memory store that holds what a stranger could write."""

from __future__ import annotations

import ast
import logging
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart.base.events import Event
from stalwart.monitor import MonitorConfig, auto, jobsync, node_requests
from stalwart.monitor.jobsync import JobPeers, NodeRhythm
from stalwart.monitor.judge import Stalled, Verdict
from stalwart.monitor.layout import SlotSnapshot
from stalwart.monitor.learned import LearnedTimeouts
from stalwart.monitor.node_hangs import HangHandler
from stalwart.monitor.node_learned import MAX_LEARNED_BYTES, Learning, auto_settings, config_for
from stalwart.monitor.node_requests import RequestDesk
from stalwart.monitor.node_slots import Slots
from stalwart.monitor.node_state import AttemptRanks, EventSink, Rank, Window
from stalwart.monitor.node_stragglers import StragglerWatch, step_times
from stalwart.monitor.node_sync import JobSync
from stalwart.monitor.reports import ControlAction, ControlRequest, HangKind
from stalwart.monitor.timer_server import ExpiredTimer
from stalwart.monitor.wire import ControlMessage
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(60)

MONITOR = Path(__file__).resolve().parents[2] / "src" / "stalwart" / "monitor"

Events = list[tuple[Event, dict[str, Any]]]


def recorder() -> tuple[Events, Any]:
    seen: Events = []
    return seen, lambda e, f: seen.append((e, f))


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A real process of our own that the parts may signal (its own session)."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_node_parts_inherit_from_no_project_class() -> None:
    """Each part is an object of its own: no part of the monitor is a parent class of
    another, and no abstract hook waits for a sibling to fill it in."""
    for path in sorted(MONITOR.glob("node*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert node.bases == [], f"{path.name}: {node.name} has bases"
            if isinstance(node, ast.Attribute) and node.attr == "abstractmethod":
                raise AssertionError(f"{path.name}: an abstract hook")


# -- AttemptRanks and EventSink ------------------------------------------------------
def test_attempt_ranks_own_the_pids_of_their_attempt(child: subprocess.Popen[bytes]) -> None:
    ranks = AttemptRanks()
    ranks.name(0, 7)
    ranks.begin(3, {0: child.pid}, {}, None)
    (rank,) = ranks.current()
    assert (ranks.attempt, rank.global_rank, ranks.pid_of(0), ranks.pid_of(1)) == (
        3,
        7,
        child.pid,
        0,
    )
    assert ranks.owner_of(child.pid) is rank
    # A stranger on the same host (the test itself, init, a pid that never was) owns
    # nothing; asking twice gives the same answer.
    for pid in (os.getpid(), 1, 2**22 + 12345, os.getpid()):
        assert ranks.owner_of(pid) is None
    assert ranks.claim(rank) and not ranks.claim(rank)  # one hang per rank and attempt
    assert ranks.armed() == [] and ranks.watched()[0].pid == child.pid
    assert ranks.end() == [rank] and ranks.current() == [] and ranks.attempt is None
    assert ranks.owner_of(child.pid) is None  # the attempt is over


def test_event_sink_outlives_a_broken_sink(caplog: pytest.LogCaptureFixture) -> None:
    def broken(event: Event, fields: dict[str, Any]) -> None:
        raise OSError("disk full")

    EventSink(broken)(Event.STRAGGLER, {})  # logged, never raised into a scanner
    assert "log_event(" in caplog.text


# -- Slots -------------------------------------------------------------------------
def test_slots_are_fresh_each_attempt_and_leave_nothing(tmp_path: Path) -> None:
    seen, emit = recorder()
    path = tmp_path / "monitor.shm"
    path.write_bytes(b"left by an earlier monitor")
    slots = Slots(path, 2, emit)
    assert slots.read(0) is None  # before start
    slots.create()
    first = slots.mapping
    assert first is not None and slots.read(1) is not None and slots.read(1).pid == 0
    # A worker scribbles over its slot, header and all: the next attempt sees none of it.
    first[:] = os.urandom(len(first))
    slots.rebuild()
    assert slots.mapping is not first and not first.closed  # a scan may still read it
    assert slots.read(0).pid == 0 and slots.read(1).pid == 0
    slots.rebuild()
    assert first.closed
    slots.note_bad_fields(0, 99, ["last_hb", "iteration"])
    slots.note_bad_fields(0, 99, ["last_hb"])  # logged once per segment
    assert [f["fields"] for e, f in seen if e is Event.MONITOR_BAD_SLOT] == [
        ["last_hb", "iteration"]
    ]
    slots.close()
    assert list(tmp_path.iterdir()) == [] and slots.read(0) is None


# -- Learning ----------------------------------------------------------------------
def warm_rhythm(beats: int, relearning: bool = False) -> auto.Rhythm:
    return auto.Rhythm(beats=beats, warm_since=0.0, names={"step"}, relearning=relearning)


LEARNED = LearnedTimeouts(hb=4.0, sections={"step": 3.0}, oos=2.0)


@pytest.mark.parametrize(
    ("config", "learned", "rhythm", "expected"),
    [
        # Not warm, nothing learned: the initial timeout everywhere auto is on.
        (MonitorConfig(hb_auto=True, section_auto=True, auto_warmup_steps=10),
         LearnedTimeouts(), warm_rhythm(2), (None, None, {"step": None})),
        # Warm: the learned values.
        (MonitorConfig(hb_auto=True, section_auto=True, oos_auto=True, auto_warmup_steps=2),
         LEARNED, warm_rhythm(2), (4.0, 2.0, {"step": 3.0})),
        # Learned earlier (a restart): judged by them from the first step on...
        (MonitorConfig(hb_auto=True, auto_warmup_steps=10), LEARNED, warm_rhythm(1),
         (4.0, None, {})),
        # ...unless a new section sent the rank back to warm-up.
        (MonitorConfig(hb_auto=True, auto_warmup_steps=10), LEARNED, warm_rhythm(1, True),
         (None, None, {})),
        # Numbers the user gave are kept.
        (MonitorConfig(hb_timeout=9.0, section_auto=True, section_timeouts={"step": 5.0},
                       auto_warmup_steps=2), LEARNED, warm_rhythm(2), (9.0, None, {"step": 5.0})),
    ],
)  # fmt: skip
def test_config_for_is_a_table(
    config: MonitorConfig,
    learned: LearnedTimeouts,
    rhythm: auto.Rhythm,
    expected: tuple[float | None, float | None, dict[str, float | None]],
) -> None:
    out = config_for(config, auto_settings(config), learned, rhythm, now=100.0)
    pre = config.auto_initial_timeout
    hb, oos, sections = expected
    assert out.hb_timeout == (pre if hb is None and config.hb_auto else hb)
    assert out.out_of_section_timeout == (pre if oos is None and config.oos_auto else oos)
    assert out.section_timeouts == {k: pre if v is None else v for k, v in sections.items()}
    if out.hb_timeout is not None and out.effective_initial_timeout is not None:
        assert out.effective_initial_timeout >= out.hb_timeout


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\xff" * 10,
        b"[1, 2]",
        b'{"version": 1, "heartbeat": {"subsequent": -5}}',
        b'{"version": 1, "heartbeat": {"subsequent": Infinity}}',
        b'{"version": 1, "sections": {"step": 1e400}}',
        b"[" * 100_000,
        b'{"version": 1, "out_of_section": 2.0, "pad": "' + b"x" * MAX_LEARNED_BYTES + b'"}',
    ],
    ids=["binary", "list", "negative", "infinite", "overflow", "deep", "oversized"],
)
def test_learning_ignores_a_hostile_file_and_keeps_going(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "learned_timeouts.json"
    path.write_bytes(content)
    seen, emit = recorder()
    learning = Learning(MonitorConfig(hb_auto=True), path, emit)
    learning.read()
    assert learning.current == LearnedTimeouts() and seen == []
    assert path.read_bytes() == content  # nothing half-written over it
    # The part still learns and replaces it whole.
    assert learning.fold(LearnedTimeouts(hb=3.0), "observed")
    assert jobsync.decode_learned(path.read_bytes()).hb == 3.0


def test_learning_only_raises_keeps_the_floor_and_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "learned_timeouts.json"
    seen, emit = recorder()
    changes: list[int] = []
    config = MonitorConfig(hb_auto=True, auto_floor=1.0)
    learning = Learning(config, path, emit, lambda: changes.append(1))
    assert learning.fold(LearnedTimeouts(hb=0.01, oos=5.0), "job")  # hb raised to the floor
    assert learning.current.hb == 1.0 and learning.current.oos == 5.0
    assert not learning.fold(LearnedTimeouts(hb=0.5, oos=4.0), "job")  # never lowered
    assert [f["source"] for e, f in seen if e is Event.TIMEOUTS_LEARNED] == ["job"]
    again = Learning(config, path, emit)
    again.read()
    assert again.current == learning.current
    # A rank's slot, read over a few steps, warms its rhythm; update() folds it in.
    config = MonitorConfig(hb_auto=True, auto_warmup_steps=2, auto_floor=0.1)
    fresh = Learning(config, None, emit, lambda: changes.append(1))
    for step in range(8):
        snap = SlotSnapshot(
            pid=123, beats=step + 1, state=1, attach_time=1.0, last_hb=10.0 + step * 0.2,
            iteration=step, oos_start=0.0, hb_initial_override=0.0, hb_override=0.0,
            oos_override=0.0, last_section=-1, name_count=0, open_times=(), limits=(),
        )  # fmt: skip
        fresh.judged_by(0, snap, [], 10.0 + step * 0.2)
    fresh.update()
    assert fresh.current.hb is not None and fresh.current.hb >= 0.2 and changes == [1]
    fresh.new_attempt()
    fresh.update()
    assert changes == [1]  # the rhythms were the last attempt's


# -- StragglerWatch ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("progress", "expected", "kept"),
    [
        ([(0.5, 1), (1.0, 3), (2.0, 5)], 0.375, [(2.0, 5)]),
        ([(0.5, 1), (2.0, 1)], None, [(2.0, 1)]),  # did not move
        ([(-5.0, 1), (2.0, 9)], None, [(2.0, 9)]),  # one point inside the window
        ([], None, []),
        ([(1.0, 9), (2.0, 3)], None, [(2.0, 3)]),  # a slot that went backwards
    ],
)
def test_step_times_is_a_table(
    progress: list[tuple[float, int]], expected: float | None, kept: list[tuple[float, int]]
) -> None:
    assert step_times(progress, now=2.0, window=2.0) == (expected, kept)


def watch_of(config: MonitorConfig) -> tuple[StragglerWatch, Events, list[ControlRequest]]:
    seen, emit = recorder()
    asked: list[ControlRequest] = []
    return StragglerWatch(config, emit, asked.append, lambda lr: 1000 + lr, host="h"), seen, asked


def test_straggler_watch_names_the_slow_rank_once_a_window() -> None:
    watch, seen, asked = watch_of(MonitorConfig(straggler_window=1.0, straggler_restart=True))
    ranks = [Rank(lr, 10 + lr, 1000 + lr, None, None) for lr in range(3)]
    assert watch.measure(ranks, 0, now=100.0) is None  # the first window starts now
    for r in ranks:
        per_step = 0.3 if r.local_rank == 2 else 0.1
        r.progress = [(100.0 + i * per_step, i) for i in range(4)]
    window = watch.measure(ranks, 0, now=101.0)
    assert window is not None and window.rhythm.host == "h"
    assert window.local_ranks == {10: 0, 11: 1, 12: 2}
    assert watch.measure(ranks, 0, now=101.5) is None  # not a window later yet
    watch.judge_alone(window)
    named = [f for e, f in seen if e is Event.STRAGGLER]
    assert [(f["global_rank"], f["ratio"]) for f in named] == [(12, 3.0)]
    assert asked == []  # alone on its node: no elastic job to leave
    watch.report({12: 3.0}, {12: 0.3, 3: 0.1}, {12: "h", 3: "g"}, window, None, 2)
    assert asked == []  # and that was this attempt's one try
    # In an elastic job the node asks to leave once per attempt, with the rank's pid.
    watch.new_attempt()
    peers = JobPeers(object(), 0, 0, 2, elastic=True)  # type: ignore[arg-type]
    for _ in range(2):
        watch.report({12: 3.0}, {12: 0.3, 3: 0.1}, {12: "h", 3: "g"}, window, peers, 2)
    assert [(r.action, r.pid) for r in asked] == [(ControlAction.EXCLUDE_NODE, 1002)]
    watch.new_attempt()
    watch.report({3: 3.0}, {12: 0.1, 3: 0.3}, {12: "h", 3: "g"}, window, peers, 2)
    assert len(asked) == 1  # another node's rank: that node names it


# -- JobSync -----------------------------------------------------------------------
class Store:
    """What a TCPStore answers, in memory; anyone on the network could have written it."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return [self.data.get(k) for k in keys]

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value


def test_job_sync_shares_only_in_a_job_of_several_nodes() -> None:
    config = MonitorConfig(hb_auto=True, straggler_window=1.0)
    learning = Learning(config, None, lambda e, f: None)
    watch, _, _ = watch_of(config)
    sync = JobSync(config, learning, watch)
    window = Window(NodeRhythm("h", 1.0, {0: 0.3, 1: 0.1}), {0: 0, 1: 1}, 0)
    assert not sync.offer(window)  # not in a job: the caller compares it
    sync.join(JobPeers(Store(), 0, 0, 1))  # a one-node round shares nothing
    assert not sync.offer(window)
    sync.close()


def test_job_sync_ignores_what_a_stranger_wrote_in_the_store(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = MonitorConfig(hb_auto=True, straggler_window=1.0, auto_floor=0.5)
    _, emit = recorder()
    learning = Learning(config, None, emit)
    watch, seen, _ = watch_of(config)
    sync = JobSync(config, learning, watch)
    store = Store()
    peers = JobPeers(store, 0, 0, 4)
    # Node 1: garbage; node 2: oversized; node 3: a real, small value (raised to the floor).
    store.data[jobsync.learned_key(0, 1)] = b"\xff{not json"
    store.data[jobsync.learned_key(0, 2)] = b"{" + b" " * (jobsync.MAX_VALUE_BYTES + 1) + b"}"
    store.set(jobsync.learned_key(0, 3), jobsync.encode_learned(LearnedTimeouts(hb=0.01)))
    store.data[jobsync.rhythm_key(0, 1)] = b'{"host": "x", "window": -1, "step_times": {}}'
    store.data[jobsync.rhythm_key(0, 2)] = b"x" * (jobsync.MAX_VALUE_BYTES + 1)
    store.set(jobsync.rhythm_key(0, 3), NodeRhythm("g", 1.0, {30: 0.1}, seq=1).encode())
    store.add(jobsync.learned_version_key(0), 1)
    caplog.set_level(logging.WARNING, logger="stalwart.monitor.node_sync")
    assert sync.offer(Window(NodeRhythm("h", 1.0, {0: 0.3}), {0: 0}, 0)) is False
    sync._peers = peers  # as join() sets it, without starting the thread
    assert sync.offer(Window(NodeRhythm("h", 1.0, {0: 0.3}), {0: 0}, 0))
    for _ in range(2):
        sync.sync_once(peers)
    assert learning.current.hb == 0.5  # the real value, at the floor; the rest ignored
    named = [(f["global_rank"], f["nodes_compared"]) for e, f in seen if e is Event.STRAGGLER]
    assert named == [(0, 2)]  # compared with the one readable node only
    warnings = [r.getMessage() for r in caplog.records if r.name.endswith("node_sync")]
    assert len(warnings) == 4, warnings  # one per bad key, not one per poll


# -- RequestDesk -------------------------------------------------------------------
def desk_of(
    child: subprocess.Popen[bytes],
) -> tuple[RequestDesk, AttemptRanks, Events, list[tuple[Rank, int, Verdict, int]]]:
    seen, emit = recorder()
    ranks = AttemptRanks()
    ranks.begin(0, {0: child.pid}, {}, {0: 5})
    hung: list[tuple[Rank, int, Verdict, int]] = []
    desk = RequestDesk(ranks, Slots(Path("/nonexistent"), 1, emit), emit,
                       lambda *a: hung.append(a))  # fmt: skip
    return desk, ranks, seen, hung


def test_request_desk_takes_requests_from_workers_only(
    child: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    desk, ranks, seen, hung = desk_of(child)
    # The worker claims to be rank 99: it is queued as the rank it was registered as.
    desk.on_control(ControlMessage(child.pid, 99, ControlAction.SHUTDOWN_WORKLOAD))
    (req,) = desk.poll()
    assert (req.global_rank, req.local_rank, req.pid) == (5, 0, child.pid)
    # A stranger that is alive waits (bounded) for its attempt; then it is refused once.
    monkeypatch.setattr(node_requests, "CONTROL_GRACE", 0.0)
    for _ in range(3):
        desk.on_control(ControlMessage(os.getpid(), 0, ControlAction.EXCLUDE_NODE))
    assert desk.poll() == []
    refused = [f for e, f in seen if e is Event.CONTROL_REQUEST_REFUSED]
    assert refused == [{"pid": os.getpid(), "action": "exclude_node"}]
    # A flood of requests from unknown live pids is held in bounded memory.
    monkeypatch.setattr(node_requests, "CONTROL_GRACE", 60.0)
    for _ in range(node_requests.MAX_PENDING_CONTROLS * 4):
        desk.on_control(ControlMessage(os.getpid(), 0, ControlAction.SHUTDOWN_WORKLOAD))
    assert len(desk._pending_controls) == node_requests.MAX_PENDING_CONTROLS
    # An expired timer kills only a worker: a stranger's is logged once, never signalled.
    for _ in range(2):
        desk.on_timer_expired(ExpiredTimer(1, "forged", signal.SIGKILL, 0.0, 1.0))
    assert hung == [] and len([e for e, _ in seen if e is Event.TIMER_EXPIRED]) == 1
    desk.on_timer_expired(ExpiredTimer(child.pid, "step", signal.SIGTERM, 0.0, 2.5))
    ((rank, target, verdict, sig),) = hung
    assert (rank.pid, target, verdict.kind, verdict.section, verdict.timeout, sig) == (
        child.pid, child.pid, HangKind.TIMER, "step", 2.5, signal.SIGTERM,
    )  # fmt: skip
    assert ranks.end()  # nothing was signalled by the desk itself
    assert child.poll() is None


# -- HangHandler -------------------------------------------------------------------
def test_hang_handler_reports_then_terminates_then_kills(
    tmp_path: Path, child: subprocess.Popen[bytes]
) -> None:
    seen, emit = recorder()
    ranks = AttemptRanks()
    ranks.begin(4, {0: child.pid}, {}, {0: 2})
    slots = Slots(tmp_path / "monitor.shm", 1, emit)
    slots.create()
    woken: list[int] = []
    config = MonitorConfig(stack_dump_wait=0.0, term_grace=0.2)
    hangs = HangHandler(config, ranks, slots, emit, tmp_path, lambda: woken.append(1))
    (rank,) = ranks.current()
    verdict = Verdict(HangKind.HEARTBEAT, None, 1.0, 1.5, 7, stalled_since=1.0)
    stalled = Stalled(0, 2, 7, 1.0)
    assert hangs.blame([stalled]) == [stalled]
    hangs.begin(rank, child.pid, verdict, signal.SIGSTOP, stalled=stalled)
    hangs.begin(rank, child.pid, verdict, signal.SIGSTOP)  # one hang per rank and attempt
    assert woken == [1] and hangs.next_due() is not None
    # A rank found later is compared with the one already under way.
    later = Stalled(1, 3, 7, 5.0)
    assert hangs.blame([later]) == [stalled, later]
    hangs.run_due()
    (report,) = hangs.poll()
    assert (report.global_rank, report.pid, report.kind, report.iteration) == (
        2, child.pid, HangKind.HEARTBEAT, 7,
    )  # fmt: skip
    assert report.dossier is not None and Path(report.dossier).exists()
    (fields,) = [f for e, f in seen if e is Event.HANG_DETECTED]
    assert fields["attempt"] == 4
    # SIGSTOP does not end it: SIGKILL follows after the grace period.
    wait_for(lambda: hangs.run_due() or child.poll() is not None, 10, "SIGKILL after grace")
    assert child.returncode == -signal.SIGKILL
    assert hangs.poll() == [] and hangs.next_due() is None
    slots.close()


def test_hang_handler_end_attempt_reports_what_is_pending(
    tmp_path: Path, child: subprocess.Popen[bytes]
) -> None:
    _, emit = recorder()
    ranks = AttemptRanks()
    ranks.begin(0, {0: child.pid}, {}, {0: 0})
    config = MonitorConfig(stack_dump_wait=0.0, term_grace=30.0)
    hangs = HangHandler(config, ranks, Slots(tmp_path / "s", 1, emit), emit, None, lambda: None)
    (rank,) = ranks.current()
    hangs.begin(rank, child.pid, Verdict(HangKind.SECTION, "step", 2.0, None, None), 0)
    hangs.end_attempt()  # before the scanner ran the step: reported and signalled now
    (report,) = hangs.poll()
    assert report.section == "step" and report.dossier is None
    assert child.wait(timeout=10) == -signal.SIGKILL  # term_signal 0 means SIGKILL
    hangs.new_attempt()
    assert hangs.blame([Stalled(0, 0, None, None)])[0].global_rank == 0
