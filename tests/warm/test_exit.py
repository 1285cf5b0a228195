"""A warm worker whose script ended exits at once, not after seconds of shutdown."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch.helpers import clean_env, events, start_stalwart, wait_for

HERE = Path(__file__).parent
pytestmark = pytest.mark.timeout(150)


def test_warm_worker_exits_faster_than_a_cold_one_after_its_script_ends(
    tmp_path: Path,
) -> None:
    # The interpreter's shutdown is CPU work (collections over every object, module
    # teardown); on a shared machine its wall time scales with the load.  So the warm
    # and the cold job end at the same moment, under the same load, and are compared.
    # Before the template froze its heap, a warm worker's shutdown walked torch's
    # objects as a cold one does, and copied each page it touched: 11-16 s against
    # 2.6-3.7 s frozen, at a load of 15 on 2 cores (about 1.2 s and 0.35 s of CPU).
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
    for mode, proc in jobs.items():
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
        exited = [
            float(e["exited_at"]) for e in events(tmp_path / mode) if e["event"] == "worker_exit"
        ]
        end = float((out / f"end_{mode}").read_text())
        shutdown[mode] = exited[0] - end
    print("end of script -> exit, s:", shutdown)
    assert shutdown["warm"] < 0.5 * shutdown["cold"], shutdown
