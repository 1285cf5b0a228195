"""A script without an ``if __name__ == "__main__":`` guard runs its body exactly once
per rank and attempt, whatever stalwart starts beside it (issue 20 item 1).

The checkpoint writer used to be started with multiprocessing's ``spawn``, which
re-imports the main module: the whole script ran again in the writer child, where it
either hung or trained beside the real rank."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from tests.helpers import stalwart, warm_and_cold

HERE = Path(__file__).parent
SCRIPT = HERE / "warmwriter_guardless.py"
pytestmark = pytest.mark.timeout(240)


@warm_and_cold
@pytest.mark.parametrize("ram", [False, True], ids=["disk", "ram"])
def test_a_guardless_script_runs_once_per_rank_and_attempt(tmp_path: Path, ram: bool) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    args: list[str | Path] = [
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--log-dir",
        tmp_path / "runs",
        "--inject",
        "crash:rank=1,step=12",
    ]
    if ram:
        args += ["--ckpt-ram", "16MiB"]
    proc = stalwart(*args, SCRIPT, markers, tmp_path / "ckpt", 20, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bodies = sorted(p.name for p in markers.iterdir() if not p.name.startswith("done-"))
    parsed = [re.fullmatch(r"r(\d+)-a(\d+)-p\d+-(.+)", name) for name in bodies]
    assert all(parsed), bodies
    runs = sorted((int(m[1]), int(m[2]), m[3]) for m in parsed if m)
    # Attempt 0 crashed at step 12 (rank 1); attempt 1 resumed and finished.
    assert runs == [
        (0, 0, "__main__"),
        (0, 1, "__main__"),
        (1, 0, "__main__"),
        (1, 1, "__main__"),
    ], bodies
    # Both ranks of the restarted attempt resumed from the same checkpoint, not step 0
    # (step 10's save may still be in flight when the crash at step 12 comes).
    starts = {(markers / f"done-r{rank}-a1").read_text() for rank in (0, 1)}
    assert starts in ({"5"}, {"10"}), starts


STALLS = HERE / "warmwriter_stalls.py"


@pytest.mark.parametrize("ram", [False, True], ids=["disk", "ram"])
def test_the_second_save_after_a_restart_stalls_no_more_than_the_median(
    tmp_path: Path, ram: bool
) -> None:
    # The restarted worker's writer used to be a fresh interpreter still importing torch
    # when the second save came: that save waited for the first one's write (1.4 s in
    # the README's job).  Forked from the warm worker's seed, it is ready at once.
    out = tmp_path / "out"
    out.mkdir()
    args: list[str | Path] = [
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--log-dir",
        tmp_path / "runs",
        "--inject",
        "crash:rank=1,step=17",
    ]
    if ram:
        args += ["--ckpt-ram", "16MiB"]
    proc = stalwart(*args, STALLS, out, tmp_path / "ckpt", 60, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        stalls = json.loads((out / f"stalls-r{rank}-a1.json").read_text())
        assert len(stalls) >= 6, stalls
        # 50 ms of slack: a loaded machine's scheduling noise, far below a writer start.
        assert stalls[1] <= statistics.median(stalls) + 0.05, (rank, stalls)
