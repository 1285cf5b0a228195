"""The hang dossier: every local rank's state and stacks in the run folder, written before
the hung rank is terminated; torch's flight recorder asked for a dump where enabled."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import pytest

from stalwart.monitor import HangReport
from stalwart.monitor.dossier import (
    FR_BUFFER_ENV,
    FR_PIPE_ENV,
    describe,
    flight_recorder_pipe,
    request_flight_recorder_dump,
)
from stalwart.monitor.layout import MAX_SECTIONS, SlotSnapshot, SlotState
from tests.helpers import wait_for

from .conftest import Harness
from .test_hangs import fast

ZERO = (0.0,) * MAX_SECTIONS
BASE = SlotSnapshot(
    pid=10, beats=0, state=SlotState.ATTACHED, attach_time=100.0, last_hb=0.0,
    iteration=-1, oos_start=100.0, hb_initial_override=0.0, hb_override=0.0,
    oos_override=0.0, last_section=-1, name_count=0, open_times=ZERO, limits=ZERO,
)  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "names", "expected"),
    [
        ({}, [], "no iteration reported; no heartbeat yet; out of any section for 5.000s"),
        (
            {"iteration": 79, "last_hb": 104.5, "name_count": 2,
             "open_times": (0.0, 103.0, *ZERO[2:])},
            ["data", "fwd"],
            "iteration 79; last heartbeat 0.500s ago; in section 'fwd' for 2.000s",
        ),
        ({"pid": 0}, [], "no monitoring client attached"),
        # a timestamp outside the attempt is not believed: no age given for it
        ({"last_hb": 1e12}, [], "no iteration reported; no heartbeat yet; out of any section for 5.000s"),
    ],
)  # fmt: skip
def test_describe_table(changes: dict[str, object], names: list[str], expected: str) -> None:
    snap = dataclasses.replace(BASE, **changes)  # type: ignore[arg-type]
    assert describe(snap, names, 105.0, floor=99.0) == expected


def test_flight_recorder_pipe_only_when_enabled() -> None:
    on = {FR_PIPE_ENV: "/tmp/fr_", FR_BUFFER_ENV: "2000"}
    assert flight_recorder_pipe(on, 3) == Path("/tmp/fr_3.pipe")
    assert flight_recorder_pipe({**on, FR_BUFFER_ENV: "0"}, 3) is None
    assert flight_recorder_pipe({**on, FR_BUFFER_ENV: "x"}, 3) is None
    assert flight_recorder_pipe({FR_BUFFER_ENV: "2000"}, 3) is None


def test_dump_request_only_into_a_fifo_with_a_reader(tmp_path: Path) -> None:
    plain = tmp_path / "plain.pipe"
    plain.write_text("")
    assert not request_flight_recorder_dump(plain)
    assert plain.read_text() == ""
    fifo = tmp_path / "fr_0.pipe"
    os.mkfifo(fifo)
    assert not request_flight_recorder_dump(fifo)  # nobody reading: never blocks
    assert not request_flight_recorder_dump(tmp_path / "absent.pipe")


@pytest.mark.timeout(90)
def test_dossier_has_every_rank_before_the_kill(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's flight recorder would listen on <stem><global rank>.pipe; play its part.
    stem = str(tmp_path / "fr_")
    monkeypatch.setenv(FR_PIPE_ENV, stem)
    monkeypatch.setenv(FR_BUFFER_ENV, "2000")
    readers = {}
    for r in (0, 1):
        os.mkfifo(f"{stem}{r}.pipe")
        readers[r] = os.open(f"{stem}{r}.pipe", os.O_RDONLY | os.O_NONBLOCK)
    run = tmp_path / "runfolder"
    run.mkdir()
    mon = harness.start(fast(hb_timeout=1.0), nranks=2, state_dir=run)
    hung = harness.spawn(0, "stop_heartbeat")
    busy = harness.spawn(1, "healthy", "100000", "0.05")
    mon.begin_attempt(
        3,
        {0: hung.pid, 1: busy.pid},
        stderr_paths={0: harness.stderr_path(0), 1: harness.stderr_path(1)},
    )
    harness.wait_ready(0)
    harness.wait_ready(1)
    found: list[HangReport] = []
    wait_for(lambda: found.extend(mon.poll_hangs()) or found, 20, "the hang")
    (report,) = found
    path = run / "hang-dossier-attempt3.txt"
    assert report.dossier == str(path)
    text = path.read_text()
    head0, rest = text.split("== rank 0 ", 1)[1], text.split("== rank 1 ", 1)[1]
    assert "HUNG: heartbeat timeout 1s" in head0 and "iteration 2" in head0
    assert "stop_heartbeat" in head0 or "time.sleep" in head0 or "worker.py" in head0
    assert "not found hung" in rest and "in section 'step'" in rest
    assert "worker.py" in rest  # the healthy rank's stacks, asked for although not hung
    assert text.count("flight recorder dump requested") == 2
    assert os.read(readers[0], 16) == b"1" and os.read(readers[1], 16) == b"1"
    assert hung.wait(timeout=10) == -signal.SIGTERM
    assert busy.poll() is None  # asked for stacks, not killed
    assert dict(harness.events)["hang_detected"]["dossier"] == str(path)
    for fd in readers.values():
        os.close(fd)
