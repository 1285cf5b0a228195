"""The stacks a hang report shows are the ones taken when the hang was found (issue 22,
item 3): a rank waiting on a stopped peer is not shown where it went once the monitor
continued that peer for its own dump. And an evaluation pass that waits on slow data
between batches (little CPU, no optimizer step for seconds) is not a hang (item 2).

One job run (a program without stalwart and without a ``__main__`` guard; rank 1
SIGSTOPs itself before a barrier rank 0 waits in; the restarted attempt evaluates for
3 s, judged by the rhythm learned before) serves the event, the dossier and the HTML
page of ``stalwart report``.
"""

from __future__ import annotations

import html
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT, STALWART, clean_env, events, run_dir, stalwart_argv

JOB = Path(__file__).parent / "progress_jobs" / "progressbench_stop_then_eval.py"

pytestmark = pytest.mark.timeout(150)


def test_victims_stacks_are_those_taken_at_detection(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = subprocess.run(
        stalwart_argv("--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", logs, JOB),
        capture_output=True, text=True, timeout=140, cwd=ROOT,
        env=clean_env(PJ_WORK=str(tmp_path), PJ_STEPS="50", PJ_STOP_AT="40"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    evs = events(logs)
    # The evaluation pass of attempt 1 ran to its end, and nothing was killed for it.
    recs = (tmp_path / "p.jsonl").read_text()
    assert '"event": "evaluated", "attempt": 1' in recs, recs
    assert [e["attempt"] for e in evs if e["event"] == "hang_detected"] == [0, 0], evs
    hangs = {e["global_rank"]: e for e in evs if e["event"] == "hang_detected"}
    assert hangs[1]["waiting_on"] is None and "stopped" in hangs[1]["evidence"], hangs
    # Rank 0 is reported with the stack it had when rank 1's hang was found: in the
    # barrier, never past it (rank 1, continued to dump its stacks, runs on).
    victim = hangs[0]
    assert victim["waiting_on"] == 1, victim
    assert "in waiting_for_rank_1" in victim["stacks"], victim["stacks"]
    assert "resumed_past_the_barrier" not in victim["stacks"], victim["stacks"]
    assert victim["stacks"].count("most recent call first") <= 2, victim["stacks"]  # one dump
    dossier = (run_dir(logs) / "hang-dossier-attempt0.txt").read_text()
    assert "in waiting_for_rank_1" in dossier
    page = tmp_path / "run.html"
    rep = subprocess.run(
        [*STALWART, "report", str(logs), "--html", str(page)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=clean_env(),
    )  # fmt: skip
    assert rep.returncode == 0, rep.stderr
    shown = {
        int(m[1]): html.unescape(m[2])
        for m in re.finditer(
            r"attempt 0, rank (\d+): stacks of the hang</summary><pre>(.*?)</pre>",
            page.read_text(),
            re.S,
        )
    }
    assert "in waiting_for_rank_1" in shown[0] and "resumed_past_the_barrier" not in shown[0]
    assert "in <module>" in shown[1]
