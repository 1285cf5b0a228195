"""RAM snapshots and the resume agreement under a real ``stalwart run`` with 2 ranks.

Real launcher, real worker crashes and restarts, real store / gloo process group.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from stalwart.checkpoint import ramlayout as rl
from tests.helpers import ROOT, clean_env, events, stalwart, stalwart_argv, wait_for

pytestmark = pytest.mark.timeout(240)

JOB = Path(__file__).parent / "scripts" / "ram_job.py"


def _run(*args: str | Path, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    return stalwart(*args, timeout=timeout)


def _results(out: Path) -> list[dict[str, object]]:
    return [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_restarted_job_resumes_from_ram_without_the_disk(tmp_path: Path, warm: bool) -> None:
    out = tmp_path / "out"
    out.mkdir()
    ckpt = tmp_path / "ckpt"
    res = _run(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--ckpt-ram",
        "4MiB",
        *([] if warm else ["--no-warm"]),
        "--log-dir",
        tmp_path / "logs",
        JOB,
        "--ckpt",
        ckpt,
        "--out",
        out,
        "--mode",
        "crash",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    for r in _results(out):
        assert r == {"step": 5, "source": "ram", "ok": True, "pid": r["pid"]}
    # Nothing was ever persisted: the state came from the launcher's memory alone.
    assert not list(ckpt.glob("step_*"))
    # The launcher said where it reserved the memory, and freed it when the job ended.
    reserved = [e for e in events(tmp_path / "logs") if e["event"] == "ckpt_ram_reserved"]
    assert len(reserved) == 1 and reserved[0]["bytes_per_rank"] == 4 << 20
    assert not Path(reserved[0]["folder"]).exists()


@pytest.mark.parametrize("pg", [False, True], ids=["store", "gloo"])
def test_a_corrupt_newest_file_on_one_rank_moves_every_rank_back(tmp_path: Path, pg: bool) -> None:
    out = tmp_path / "out"
    out.mkdir()
    res = _run(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--log-dir",
        tmp_path / "logs",
        JOB,
        "--ckpt",
        tmp_path / "ckpt",
        "--out",
        out,
        "--mode",
        "corrupt",
        *(["--pg"] if pg else []),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = _results(out)
    # Rank 0's step 5 is fine, rank 1's is not: both resume from step 4, from disk.
    assert [(r["step"], r["source"], r["ok"]) for r in results] == [(4, "disk", True)] * 2


def test_no_room_for_ckpt_ram_is_one_line_at_setup(tmp_path: Path) -> None:
    res = _run("--ckpt-ram", "100TiB", "--log-dir", tmp_path / "logs", JOB, timeout=120)
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "--ckpt-ram 102400.00 GiB" in errors[0], res.stderr
    assert "snapshot memory" in errors[0]
    assert not (tmp_path / "out").exists()


def test_a_bad_ckpt_ram_value_is_refused(tmp_path: Path) -> None:
    res = _run("--ckpt-ram", "lots", JOB, timeout=60)
    assert res.returncode == 2
    assert "--ckpt-ram 'lots': expected a size" in res.stderr


_SLEEPER = """
import os, sys, time, pathlib
pathlib.Path(sys.argv[1]).write_text(os.environ.get(sys.argv[2], ""))
time.sleep(600)
"""


def test_the_guardian_frees_snapshot_memory_after_a_launcher_sigkill(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(_SLEEPER)
    seen = tmp_path / "ramdir.txt"
    proc = subprocess.Popen(
        stalwart_argv(
            "--ckpt-ram", "1MiB", "--log-dir", tmp_path / "logs", script, seen, rl.RAM_DIR_ENV
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=clean_env(),
        cwd=ROOT,
    )
    try:

        def started() -> bool:
            if seen.exists() and seen.read_text():
                return True
            assert proc.poll() is None, "launcher exited early"
            return False

        wait_for(started, 120, "the worker to start", interval=0.05)
        folder = Path(seen.read_text())
        assert folder.is_dir() and (folder / rl.segment_name(0)).is_file()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        wait_for(lambda: not folder.exists(), 30, f"{folder} to go with the launcher", 0.05)
    finally:
        proc.kill()
        proc.wait()
