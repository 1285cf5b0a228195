"""A warm worker whose script ended exits at once, not after seconds of shutdown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import clean_env, events, start_stalwart, wait_for

HERE = Path(__file__).parent
pytestmark = pytest.mark.timeout(150)


def test_warm_worker_shutdown_skips_the_templates_objects(
    tmp_path: Path,
) -> None:
    # The interpreter's shutdown is CPU work (collections over every object, module
    # teardown).  Before the template froze its heap, a warm worker's shutdown walked
    # torch's objects as a cold one does, and copied each page it touched: 11-16 s
    # against 2.6-3.7 s frozen, at a load of 15 on 2 cores (about 1.2 s and 0.35 s of
    # CPU).  How much faster is a benchmark's question (bench/bench_launcher_exit.py):
    # on an idle machine both exits are well under a second and their ratio is noise.
    # What this test holds is the cause: the warm worker reaches its last line with
    # torch's objects frozen, so its final collections skip them; a cold one has none.
    out = tmp_path / "out"
    out.mkdir()
    jobs = {
        mode: start_stalwart(
            "--nproc-per-node",
            "1",
            "--log-dir",
            tmp_path / mode,
            *(["--no-warm"] if mode == "cold" else []),
            HERE / "ender.py",
            out,
            mode,
            env=clean_env(),
        )
        for mode in ("warm", "cold")
    }
    try:
        wait_for(
            lambda: all((out / f"ready_{m}").exists() for m in jobs), 90, "both scripts to start"
        )
    finally:
        (out / "go").touch()
    shutdown = {}
    frozen = {}
    for mode, proc in jobs.items():
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
        exited = [
            float(e["exited_at"]) for e in events(tmp_path / mode) if e["event"] == "worker_exit"
        ]
        record = json.loads((out / f"end_{mode}").read_text())
        shutdown[mode] = exited[0] - float(record["end"])
        frozen[mode] = int(record["frozen"])
    print("end of script -> exit, s:", shutdown, "frozen objects:", frozen)
    assert frozen["cold"] == 0, frozen
    # torch.distributed alone leaves some 10^5 objects; a template that froze only a
    # few would not spare the walk.
    assert frozen["warm"] > 50_000, frozen
