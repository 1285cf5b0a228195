"""Hostile and hand-edited ``events.jsonl`` lines through every output of ``stalwart report``.

The base is a real run (two ranks, a crash, a restart); each case changes one line of
it the way a worker, an old version or a person with an editor could, and every format
(console at 80 columns, ``--json``, ``--html``, ``--png``) must still come out, with
at most one warning for the skipped line and nothing of the hostile text acting.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from stalwart.reporting.report import report_main
from tests.helpers import ROOT, STALWART, clean_env, cold_only, stalwart
from tests.launch.helpers import SCRIPTS

pytestmark = [pytest.mark.timeout(180), cold_only]

Lines = list[bytes]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The events of a real run with one crash and one restart."""
    tmp = tmp_path_factory.mktemp("base")
    logs = tmp / "logs"
    proc = stalwart(
        "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs, "--rdzv-id", "base",
        "--inject", "crash:rank=1,step=8", SCRIPTS / "timed_steps.py", tmp, "16", "0.02", "4",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return logs / "base" / "events.jsonl"


def _index(lines: Lines, kind: str) -> int:
    return next(i for i, ln in enumerate(lines) if json.loads(ln).get("event") == kind)


def _set(kind: str, **fields: object) -> Callable[[Lines], Lines]:
    """The first *kind* line with *fields* changed (a field of ``...`` is removed)."""

    def mutate(lines: Lines) -> Lines:
        i = _index(lines, kind)
        rec = json.loads(lines[i])
        for k, v in fields.items():
            if v is ...:
                rec.pop(k, None)
            else:
                rec[k] = v
        lines[i] = json.dumps(rec).encode()
        return lines

    return mutate


def _raw(kind: str, field: str, text: bytes) -> Callable[[Lines], Lines]:
    """The first *kind* line with *field*'s value replaced by raw JSON text."""

    def mutate(lines: Lines) -> Lines:
        i = _index(lines, kind)
        rec = json.loads(lines[i])
        rec[field] = "@@HERE@@"
        lines[i] = json.dumps(rec).encode().replace(b'"@@HERE@@"', text)
        return lines

    return mutate


def _append(line: bytes) -> Callable[[Lines], Lines]:
    return lambda lines: [*lines[:3], line, *lines[3:]]


def _cause(**fields: object) -> Callable[[Lines], Lines]:
    def mutate(lines: Lines) -> Lines:
        i = _index(lines, "restart")
        rec = json.loads(lines[i])
        rec["root_cause"].update(fields)
        lines[i] = json.dumps(rec).encode()
        return lines

    return mutate


HOSTILE_TEXT = (
    "[/red][bold]x\x1b]0;pwned\x07\x1b[2J\x1b[31mred\x9b1m\r\x08 </td><img src=x onerror=alert(1)>"
)

# (name, change, whether the changed line is skipped with a warning)
CASES: list[tuple[str, Callable[[Lines], Lines], bool]] = [
    ("time not a number", _set("worker_spawn", time="abc"), True),
    ("time missing", _set("worker_spawn", time=...), True),
    ("time huge int", _raw("rendezvous_done", "time", b"9" * 400), True),
    ("time overflowing float", _raw("rendezvous_done", "time", b"1e400"), True),
    ("time negative", _set("launcher_start", time=-5), True),
    ("time NaN", _raw("worker_exit", "time", b"NaN"), True),
    ("attempt a string", _set("rendezvous_done", attempt="0"), True),
    ("spawn rank a string", _set("worker_spawn", rank="x"), True),
    ("spawn rank missing", _set("worker_spawn", rank=...), True),
    ("step a string", _set("progress", step="12"), True),
    ("step overflowing", _raw("progress", "step", b"1" + b"0" * 30), True),
    ("step_time null", _set("progress", step_time=None), False),
    ("exited_at a word", _set("worker_exit", exited_at="later"), True),
    ("exitcode huge", _raw("worker_exit", "exitcode", b"1e30"), True),
    ("world size negative", _set("rendezvous_done", world_size=-5), True),
    ("root cause a string", _set("restart", root_cause="boom"), True),
    ("root cause rank markup", _cause(rank="<img src=x onerror=alert(1)>"), True),
    ("root cause timestamp a word", _cause(timestamp="soon"), True),
    ("event a number", _set("worker_exit", event=5), True),
    ("stall_s a word", _set("checkpoint_commit", stall_s="x"), True),
    ("a JSON array", _append(b"[1, 2, 3]"), True),
    (
        "deep nesting",
        _append(b'{"event":"x","time":1,"a":' + b"[" * 100000 + b"]" * 100000 + b"}"),
        True,
    ),
    ("not UTF-8", _append(b'{"event":"restart","time":1,"reason":"\xff\xfe"}'), True),
    ("a 2 MB line", _append(b'{"event":"x","time":1,"pad":"' + b"a" * (2 << 20) + b'"}'), True),
    ("NUL bytes", _append(b"\x00\x00\x00"), True),
    ("hostile message", _cause(message=HOSTILE_TEXT, reason=HOSTILE_TEXT), False),
    (
        "hostile run id",
        lambda ls: [ln.replace(b'"run_id":"base"', b'"run_id":"$x^{<b>}$"') for ln in ls],
        False,
    ),
]


def _run_all(events: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """Every output format of one events file; their texts by format."""
    got: dict[str, str] = {}
    assert report_main([str(events.parent)]) == 0
    got["console"] = capsys.readouterr().out
    assert report_main([str(events.parent), "--json"]) == 0
    got["json"] = capsys.readouterr().out
    page = out / "run.html"
    assert report_main([str(events.parent), "--html", str(page)]) == 0
    got["html"] = page.read_text()
    image = out / "run.png"
    assert report_main([str(events.parent), "--png", str(image)]) == 0
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    return got


@pytest.mark.parametrize(("name", "change", "skipped"), CASES, ids=[c[0] for c in CASES])
def test_every_format_survives(
    name: str,
    change: Callable[[Lines], Lines],
    skipped: bool,
    base_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    folder = tmp_path / "logs" / "base"
    folder.mkdir(parents=True)
    lines = base_run.read_bytes().splitlines()
    (folder / "events.jsonl").write_bytes(b"\n".join(change(lines)) + b"\n")
    with caplog.at_level(logging.WARNING):
        got = _run_all(folder / "events.jsonl", tmp_path, capsys)
    warnings = [r for r in caplog.records if "malformed event line" in r.getMessage()]
    assert len(warnings) == (1 if skipped else 0), [r.getMessage() for r in warnings]
    console = got["console"]
    # Nothing of a message acts on the terminal, and the tables fit 80 columns uncut.
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", console), repr(console)
    assert max(len(ln) for ln in console.splitlines()) <= 80, console
    assert "…" not in console, console
    json.loads(got["json"])
    page = got["html"]
    assert "<img" not in page and "<b>" not in page
    if name == "hostile message":
        assert r"\x1b]0;pwned" in console and "[/red]" in console


def test_json_into_a_closed_pipe_ends_quietly(base_run: Path, tmp_path: Path) -> None:
    # `stalwart report LOGS --json | head -1`: head leaves after one line, long before
    # the report of 300 runs is written (more than a pipe holds).
    for i in range(300):
        (tmp_path / f"run{i}").mkdir()
        shutil.copy(base_run, tmp_path / f"run{i}" / "events.jsonl")
    pipeline = subprocess.run(
        ["bash", "-o", "pipefail", "-c",
         f"{' '.join(STALWART)} report {tmp_path} --json | head -1"],
        capture_output=True, text=True, cwd=ROOT, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert pipeline.stdout == "{\n"
    assert pipeline.stderr == "", pipeline.stderr
    assert pipeline.returncode == 0


def test_one_warning_line_on_the_console(base_run: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    lines = base_run.read_bytes().splitlines()
    bad = [b'{"event":"progress","time":"abc"}', b"not json", b'{"event":"x","time":1e400}']
    (folder / "events.jsonl").write_bytes(b"\n".join([*lines[:4], *bad, *lines[4:]]) + b"\n")
    proc = subprocess.run(
        [*STALWART, "report", str(folder)],
        capture_output=True, text=True, cwd=ROOT, timeout=60, env=clean_env(COLUMNS="80"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "skipped 3 malformed event line(s)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_html_inserts_no_markup_from_a_record(base_run: Path, tmp_path: Path) -> None:
    """Every text field a record can carry into the page, made hostile at once."""
    folder = tmp_path / "run"
    folder.mkdir()
    payload = '"><script>alert(1)</script><svg onload=alert(2)>'
    out = []
    for ln in base_run.read_bytes().splitlines():
        rec = json.loads(ln)
        for key in ("run_id", "kind", "signal", "reason", "fault", "stacks"):
            if key in rec:
                rec[key] = payload
        if isinstance(rec.get("root_cause"), dict):
            rec["root_cause"].update(rank=payload, signal=payload, message=payload, reason=payload)
        out.append(json.dumps(rec).encode())
    (folder / "events.jsonl").write_bytes(b"\n".join(out) + b"\n")
    page = tmp_path / "run.html"
    assert report_main([str(folder), "--html", str(page)]) == 0
    text = page.read_text()
    assert "<script" not in text and "<svg onload" not in text
