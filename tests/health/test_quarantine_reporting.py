"""Quarantine in what the run reports, from events only: the closing block, ``stalwart
report`` (text and --json) and the metrics; hostile event lines are skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.core import Metric

from stalwart.reporting.metrics import RunCollector
from stalwart.reporting.quarantine import quarantine_lines
from stalwart.reporting.report import report_main
from stalwart.reporting.summary import end_block

T = 1_700_000_000.0
LINE = (
    "node b@10.0.0.2 is quarantined for the rest of the job: implicated in 3 of the last 5 "
    "failed rounds (round 2; failed, failed, failed)"
)


def _events() -> list[dict[str, object]]:
    base = {"run_id": "q", "pid": 1}
    return [
        {**base, "event": "launcher_start", "time": T},
        {**base, "event": "rendezvous_done", "time": T + 1, "attempt": 0, "world_size": 3},
        {
            **base,
            "event": "node_quarantined",
            "time": T + 9,
            "attempt": 2,
            "node": "b@10.0.0.2",
            "since_attempt": 2,
            "until": None,
            "count": 3,
            "window": 5,
            "causes": ["failed"] * 3,
            "reason": LINE,
        },
        {**base, "event": "node_quarantined", "time": T + 9, "node": "c\x1b[2J", "reason": "x"},
        {**base, "event": "node_released", "time": T + 10, "node": "c\x1b[2J"},
        {**base, "event": "job_succeeded", "time": T + 12, "attempt": 3},
        {**base, "event": "launcher_exit", "time": T + 13, "exit_code": 0},
    ]


def _write(tmp_path: Path, hostile: bool) -> Path:
    path = tmp_path / "events.jsonl"
    lines = [json.dumps(e) for e in _events()]
    if hostile:
        lines[2:2] = [
            json.dumps({"event": "node_quarantined", "time": T + 5, "node": 7}),
            json.dumps({"event": "node_quarantined", "time": T + 5}),
            json.dumps({"event": "node_quarantined", "time": T + 5, "node": "n" * 5000}),
            json.dumps({"event": "node_released", "time": T + 5, "node": ["b@10.0.0.2"]}),
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_lines_name_the_node_and_state() -> None:
    lines = quarantine_lines(_events())
    assert lines == [f"quarantined: {LINE}", "quarantined: x; released"]
    bare = [{"event": "node_quarantined", "time": T, "node": "d\n", "since_attempt": 4}]
    assert quarantine_lines(bare) == ["quarantined: node d\\x0a was quarantined (attempt 4)"]


def test_the_closing_block_lists_the_quarantined_nodes() -> None:
    block, _ = end_block(
        _events(), now=T + 13, run_id="q", outcome="succeeded", attempts=4, run_dir=None
    )
    assert f"  quarantined: {LINE}" in block.splitlines()


def test_report_shows_them_and_skips_hostile_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, hostile=True)
    assert report_main([str(path), "--json"]) == 0
    (got,) = json.loads(capsys.readouterr().out)["runs"]
    assert got["quarantined"] == [
        {"node": "b@10.0.0.2", "since_attempt": 2, "released": False},
        {"node": "c\x1b[2J", "since_attempt": None, "released": True},
    ]
    assert report_main([str(path)]) == 0
    text = capsys.readouterr().out
    assert f"quarantined: {LINE}" in " ".join(text.split())
    assert "\x1b[2J" not in text


def test_metrics_count_quarantines_and_who_is_out(tmp_path: Path) -> None:
    collector = RunCollector(_write(tmp_path, hostile=True))
    got: dict[str, float] = {}
    for fam in collector.collect():
        assert isinstance(fam, Metric)
        for s in fam.samples:
            got[s.name] = s.value
    assert got["stalwart_node_quarantines_total"] == 2
    assert got["stalwart_nodes_quarantined"] == 1
