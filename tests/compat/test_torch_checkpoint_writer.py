"""A program written for torch's experimental checkpoint process runs under
``stalwart run`` with only its import line changed: its writer is called with
``path=``/``state_dict=`` keywords, gets ``rank_info`` in its init, torch's own
``CheckpointWriter`` works, and a failed write is caught as ``RuntimeError``."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, clean_env, stalwart_argv

PROGRAM = Path(__file__).parent / "programs" / "torch_ckpt_process.py"
TORCH_IMPORT = (
    "from torch.distributed.checkpoint._experimental.checkpoint_process import "
    "CheckpointProcess, CheckpointProcessConfig"
)
TORCH_IMPORT_2 = "from torch.distributed.checkpoint._experimental.types import RankInfo"
STALWART_IMPORT = "from stalwart.checkpoint import CheckpointProcess, CheckpointProcessConfig"
STALWART_IMPORT_2 = "from stalwart.checkpoint import RankInfo"


def _check_outputs(out: Path, world_size: int) -> None:
    for rank in range(world_size):
        record = torch.load(out / "step_3" / f"tagged_{rank}.pt", weights_only=True)
        assert record["rank"] == rank and record["world_size"] == world_size
        assert record["kwargs"] == {"epoch": 7}
        assert torch.equal(record["state_dict"]["w"], torch.arange(6, dtype=torch.float32) + rank)
        assert record["state_dict"]["step"] == 3
        plain = torch.load(out / "step_5" / f"checkpoint_{rank}.pt", weights_only=True)
        assert torch.equal(plain["w"], torch.arange(6, dtype=torch.float32) + rank)
    assert not (out / "step_4").exists()


@pytest.mark.timeout(180)
def test_torch_style_writer_runs_under_stalwart_with_only_the_import_changed(
    tmp_path: Path,
) -> None:
    source = PROGRAM.read_text()
    lines = source.splitlines()
    marked = [i for i, ln in enumerate(lines) if "# IMPORT-LINE" in ln]
    assert len(marked) == 2, marked
    assert lines[marked[0]].startswith(TORCH_IMPORT)
    assert lines[marked[1]].startswith(TORCH_IMPORT_2)
    lines[marked[0]] = STALWART_IMPORT
    lines[marked[1]] = STALWART_IMPORT_2
    program = tmp_path / "program.py"
    program.write_text("\n".join(lines) + "\n")
    # Nothing but those lines differs from what torch's own process runs.
    changed = [a for a, b in zip(source.splitlines(), lines, strict=True) if a != b]
    assert len(changed) == 2
    out = tmp_path / "out"
    res = subprocess.run(
        stalwart_argv("--nproc-per-node", "2", program, out),
        capture_output=True,
        text=True,
        timeout=150,
        env=clean_env(),
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: caught RuntimeError: True" in res.stdout, res.stdout[-3000:]
        assert f"rank {rank}: done" in res.stdout, res.stdout[-3000:]
    _check_outputs(out, 2)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _torch_close_race(stderr: str) -> bool:
    if "process 0 terminated with signal SIGINT" in stderr:
        return True
    in_exit_hooks = "util._exit_function()" in stderr and "KeyboardInterrupt" in stderr
    return in_exit_hooks and "process 0 terminated with exit code 1" in stderr


@pytest.mark.timeout(150)
def test_the_program_is_valid_for_torchs_own_checkpoint_process(tmp_path: Path) -> None:
    # The reference run: the unchanged program with torch's process, one rank.
    # torch's close() is racy: its subprocess carries PR_SET_PDEATHSIG=SIGINT tied to the
    # executor thread that spawned it, and close() ends that thread before the subprocess
    # has left. A SIGINT landing while the subprocess shuts down fails close() with
    # ProcessExitedException, either as "terminated with signal SIGINT" or, when it lands
    # in multiprocessing's exit hooks, as a KeyboardInterrupt there and "exit code 1" (both
    # seen in CI, 2026-11-23). The reference run is therefore started with SIGINT ignored,
    # which the subprocess inherits through spawn and which torch's code never resets; the
    # race is torch's, not the program's. Should it still strike, only those two
    # signatures are retried; any other failure fails at once.
    failures = []
    for attempt in range(3):
        out = tmp_path / f"out{attempt}"
        res = subprocess.run(
            [sys.executable, PROGRAM, out],
            capture_output=True,
            text=True,
            timeout=45,
            env=clean_env(RANK="0", WORLD_SIZE="1"),
            check=False,
            preexec_fn=_ignore_sigint,
        )
        if res.returncode == 0:
            break
        assert _torch_close_race(res.stderr), res.stderr[-3000:]
        failures.append(res.stderr[-3000:])
    assert res.returncode == 0, failures
    assert "rank 0: caught RuntimeError: True" in res.stdout
    _check_outputs(out, 1)
