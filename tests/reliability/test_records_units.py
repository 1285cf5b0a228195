"""The pure parts behind bounded, validated records, as tables: cutting text, making it
printable, checking an event line, bounding a failure record, learned timeouts read
back, replacing a run-folder file, and rate-limited logging."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import msgspec
import pytest

from stalwart.base.files import replace_file
from stalwart.base.records import (
    MESSAGE_LIMIT,
    TRACEBACK_LIMIT,
    bounded,
    clip,
    printable,
)
from stalwart.monitor import jobsync
from stalwart.monitor.learned import LearnedTimeouts
from stalwart.rendezvous.api import (
    FAILURE_RECORD_LIMIT,
    NodeLost,
    WorkerFailed,
    bounded_failure,
    decode_failure,
)
from stalwart.reporting.event_schema import BadRecord, parse_event_line
from stalwart.reporting.metrics_http import RateLimitedLog


@pytest.mark.parametrize("size", [0, 1, 10, 99, 100, 101, 1000, 5 << 20])
@pytest.mark.parametrize("limit", [0, 5, 40, 100, 4096])
def test_clip_never_exceeds_its_limit_and_keeps_the_end(size: int, limit: int) -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(size))
    out = clip(text, limit)
    assert len(out) <= limit
    if size <= limit:
        assert out == text
    elif limit >= 60:
        start, end = out.index("\n[... "), out.index(" characters cut ...]\n")
        note = out[start : end + len(" characters cut ...]\n")]
        assert int(note.split()[1]) == size - (len(out) - len(note))  # the figure is true
        assert out.endswith(text[-(limit // 2) :])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (float("nan"), None),
        (float("inf"), None),
        (1.5, 1.5),
        (True, True),
        ("x" * 70000, "cut"),
        ({"a": [float("-inf"), "ok"]}, {"a": [None, "ok"]}),
        (Path("/p"), "/p"),
    ],
)
def test_bounded_makes_a_field_writable(value: object, expected: object) -> None:
    out = bounded(value)
    if expected == "cut":
        assert isinstance(out, str) and len(out) <= 65536
    else:
        assert out == expected
    json.dumps(out, allow_nan=False)


def test_bounded_flattens_deep_nesting() -> None:
    deep: list[object] = []
    node = deep
    for _ in range(1000):
        node.append([])
        node = node[0]  # type: ignore[assignment]
    json.dumps(bounded(deep), allow_nan=False)


@pytest.mark.parametrize(
    ("text", "newlines", "expected"),
    [
        ("plain", False, "plain"),
        ("\x1b[2J", False, "\\x1b[2J"),
        ("a\nb\tc", False, "a\\x0ab\\x09c"),
        ("a\nb\tc", True, "a\nb\tc"),
        ("\x9b31m\x07\r\x00", True, "\\x9b31m\\x07\\x0d\\x00"),
        ("é ✓ 中", False, "é ✓ 中"),
    ],
)
def test_printable(text: str, newlines: bool, expected: str) -> None:
    assert printable(text, newlines=newlines) == expected


GOOD = {"event": "progress", "time": 1.7e9, "attempt": 0, "rank": 1, "step": 3}


@pytest.mark.parametrize(
    ("change", "ok"),
    [
        ({}, True),
        ({"extra": {"anything": [1, "x"]}}, True),
        ({"time": "abc"}, False),
        ({"time": -1}, False),
        ({"time": 1e12}, False),
        ({"time": True}, False),
        ({"attempt": "0"}, False),
        ({"attempt": -2}, False),
        ({"rank": 2**40}, False),
        ({"step": None}, False),  # progress needs its step
        ({"step_time": None}, True),
        ({"root_cause": "boom"}, False),
        ({"root_cause": {"rank": "<img>"}}, False),
        ({"root_cause": {"rank": 1, "message": "m", "other": [1]}}, True),
        ({"event": 5}, False),
        ({"save_s": -1}, False),
        ({"last_heartbeat_age": 1e10}, False),
    ],
)
def test_parse_event_line(change: dict[str, object], ok: bool) -> None:
    line = json.dumps({**GOOD, **change}).encode()
    if ok:
        assert parse_event_line(line)["event"] == "progress"
    else:
        with pytest.raises(BadRecord):
            parse_event_line(line)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[1]",
        b"not json",
        b'{"event":"x","time":NaN}',
        b'{"event":"x","time":1e400}',
        b'{"event":"x","time":1,"s":"\xff"}',
        b'{"event":"x","time":1,"a":' + b"[" * 100000 + b"]" * 100000 + b"}",
        b'{"event":"x","time":1,"p":"' + b"a" * (1 << 20) + b'"}',
    ],
)
def test_parse_event_line_refuses_what_is_not_a_record(raw: bytes) -> None:
    with pytest.raises(BadRecord) as err:
        parse_event_line(raw)
    assert "\n" not in str(err.value) and len(str(err.value)) < 300


def test_bounded_failure_fits_the_store_and_reads_back() -> None:
    huge = WorkerFailed(
        node_rank=0, local_rank=1, rank=1, message="m" * (5 << 20), traceback="t" * (5 << 20),
        reason="r" * (1 << 20), host="h" * 10000, error_file="e" * 10000,
    )  # fmt: skip
    small = bounded_failure(huge)
    assert isinstance(small, WorkerFailed)
    assert len(small.message) <= MESSAGE_LIMIT and len(small.traceback) <= TRACEBACK_LIMIT
    raw = small.encode()
    assert len(raw) < FAILURE_RECORD_LIMIT
    assert decode_failure(raw) == small
    assert bounded_failure(NodeLost(node_rank=2, reason="x")) == NodeLost(node_rank=2, reason="x")
    with pytest.raises(msgspec.ValidationError):
        decode_failure(huge.encode())  # a stranger's oversized record is refused


@pytest.mark.parametrize(
    "raw",
    [
        b'{"version": 1, "heartbeat": "x"}',
        b'{"version": 1, "sections": [1]}',
        b'{"version": 1, "heartbeat": {"subsequent": Infinity}}',
        b'{"version": 1, "heartbeat": {"subsequent": 1e999}}',
        b'{"version": 1, "out_of_section": NaN}',
        b'{"version": 1, "sections": {"a": "1"}}',
        b'{"version": 1, "heartbeat": {"subsequent": 10' + b"0" * 400 + b"}}",
    ],
)
def test_decode_learned_refuses_in_one_line(raw: bytes) -> None:
    with pytest.raises(ValueError) as err:
        jobsync.decode_learned(raw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("learned", "floor", "raised"),
    [
        (LearnedTimeouts(hb=0.001, sections={"a": 0.2, "b": 9.0}, oos=3.0), 0.5, 2),
        (LearnedTimeouts(hb=2.0), 0.5, 0),
        (LearnedTimeouts(), 0.5, 0),
    ],
)
def test_at_least_raises_to_the_floor(learned: LearnedTimeouts, floor: float, raised: int) -> None:
    out, names = jobsync.at_least(learned, floor)
    assert len(names) == raised
    values = [out.hb, out.oos, *out.sections.values()]
    assert all(v is None or v >= floor for v in values)


def test_replace_file_never_writes_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "run" / "state.json"
    target.parent.mkdir()
    # Links at the target and at every name an older version used for its temp file.
    for name in ("state.json", "state.json.tmp", ".state.json.tmp"):
        (target.parent / name).symlink_to(victim)
    replace_file(target, b"new")
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and target.read_bytes() == b"new"
    assert oct(os.stat(target).st_mode & 0o777) == oct(0o600)


def test_replace_file_leaves_nothing_when_writing_fails(tmp_path: Path) -> None:
    def broken(fh: object) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        replace_file(tmp_path / "out.png", broken)
    assert list(tmp_path.iterdir()) == []


def test_rate_limited_log_counts_what_it_held(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(logging.getLogger("test.records"), every=3600)
    with caplog.at_level(logging.WARNING):
        assert log.warning("bad \x1b[2J input")
        for _ in range(100):
            assert not log.warning("bad input")
    assert len(caplog.records) == 1 and "\\x1b" in caplog.records[0].getMessage()
    log._next = 0.0  # the hour has passed
    with caplog.at_level(logging.WARNING):
        assert log.warning("again")
    assert "100 more like it" in caplog.records[-1].getMessage()
