"""The verdict made at detection is the one reported: a rank found hung as the root
cause that exited 0 (Lightning catches SIGTERM) still fails the attempt as the cause."""

from __future__ import annotations

import time

import pytest

from stalwart.launch.round.hangs import HangWatch
from stalwart.launch.workers.failures import root_cause
from stalwart.monitor import HangReport, MonitorConfig
from stalwart.monitor.reports import HangKind
from stalwart.rendezvous.api import WorkerFailed

pytestmark = pytest.mark.timeout(30)


def _report(local: int, pid: int, waiting_on: int | None) -> HangReport:
    return HangReport(
        local_rank=local, global_rank=local, pid=pid, kind=HangKind.HEARTBEAT, section=None,
        timeout=0.5, last_heartbeat_age=0.9, iteration=25, stacks="", detected_at=time.time() - 5,
        waiting_on=waiting_on, evidence="stopped (state T) at no stack" if waiting_on is None
        else "waiting on peers: distributed_c10d.py all_reduce",
    )  # fmt: skip


@pytest.fixture
def watch():  # type: ignore[no-untyped-def]
    w = HangWatch("t", MonitorConfig(), 2, lambda *a, **k: None)
    yield w
    w.stop()


def test_root_that_exited_zero_is_still_the_root_cause(watch: HangWatch) -> None:
    watch._hangs = {101: _report(1, 101, None), 100: _report(0, 100, 1)}
    # Only the victim failed (terminated); the stopped root's framework exited 0.
    failures = {0: WorkerFailed(node_rank=0, local_rank=0, pid=100, exitcode=-15, rank=0)}
    assert watch.count_hung_roots(failures, 0)
    watch.explain(failures)
    cause = root_cause(list(failures.values()))
    assert cause.rank == 1 and "stopped (state T)" in cause.reason
    assert not watch.count_hung_roots(failures, 0)  # once


def test_victims_and_roots_already_failed_are_not_added(watch: HangWatch) -> None:
    watch._hangs = {101: _report(1, 101, None), 100: _report(0, 100, 1)}
    failures = {
        0: WorkerFailed(node_rank=0, local_rank=0, pid=100, exitcode=-15, rank=0),
        1: WorkerFailed(node_rank=0, local_rank=1, pid=101, exitcode=-9, rank=1),
    }
    assert not watch.count_hung_roots(failures, 0)
    assert len(failures) == 2
