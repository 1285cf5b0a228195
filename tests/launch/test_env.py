"""Workers see the same torchrun variables under ``stalwart run`` as under ``torchrun``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import clean_env, stalwart, warm_and_cold

from .helpers import SCRIPTS

pytestmark = [pytest.mark.timeout(90), warm_and_cold]


def _load(d: Path, n: int) -> dict[int, dict[str, str]]:
    return {r: json.loads((d / f"env_{r}.json").read_text()) for r in range(n)}


def test_same_environment_as_torchrun(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    script = SCRIPTS / "envdump.py"
    proc = stalwart("--nproc-per-node", "2", "--log-dir", tmp_path / "logs", script, ours)
    assert proc.returncode == 0, proc.stderr
    tr = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--log-dir",
            str(tmp_path / "tlogs"),
            str(script),
            str(theirs),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert tr.returncode == 0, tr.stderr
    a, b = _load(ours, 2), _load(theirs, 2)
    for rank in range(2):
        assert set(a[rank]) == set(b[rank]), set(a[rank]) ^ set(b[rank])
        for key in a[rank]:
            if key in ("MASTER_PORT", "TORCHELASTIC_RUN_ID"):
                continue
            if key == "TORCHELASTIC_ERROR_FILE":
                assert a[rank][key].endswith(f"attempt_0/{rank}/error.json")
                assert b[rank][key].endswith(f"attempt_0/{rank}/error.json")
                continue
            assert a[rank][key] == b[rank][key], (key, a[rank][key], b[rank][key])
    assert a[0]["OMP_NUM_THREADS"] == "1" and a[0]["WORLD_SIZE"] == "2"
    assert a[1]["RANK"] == "1" and a[1]["LOCAL_RANK"] == "1"


def test_omp_threads_left_alone_when_set_or_single_worker(tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "--log-dir",
        tmp_path / "l",
        SCRIPTS / "envdump.py",
        out,
        env=clean_env(OMP_NUM_THREADS="3"),
    )
    assert proc.returncode == 0, proc.stderr
    assert _load(out, 2)[0]["OMP_NUM_THREADS"] == "3"
    single = tmp_path / "s"
    single.mkdir()
    proc = stalwart("--log-dir", tmp_path / "l2", SCRIPTS / "envdump.py", single)
    assert proc.returncode == 0, proc.stderr
    assert "OMP_NUM_THREADS" not in _load(single, 1)[0]


def test_single_worker_gets_default_threads_and_stays_warm(tmp_path: Path) -> None:
    """One worker per node gets torch's default thread count, warm or cold: the template
    imports torch with one thread (so that it can fork) and the worker gets them back."""
    import subprocess
    import sys

    want = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        env=clean_env(),
        check=True,
    ).stdout.strip()
    proc = stalwart("--log-dir", tmp_path / "l", SCRIPTS / "threads.py", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "threads_0").read_text() == want
    assert "warm start disabled" not in proc.stderr, proc.stderr
