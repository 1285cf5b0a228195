"""Node count, node rank and endpoint taken from SLURM / Kubernetes variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.cluster import detect, first_slurm_host

from .conftest import ROOT, free_port

ENVDUMP = ROOT / "tests" / "launch" / "scripts" / "envdump.py"


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("gpu07", "gpu07"),
        ("gpu[07-09,12],cpu3", "gpu07"),
        ("a,b", "a"),
        ("rack1-n[3-4]-ib", "rack1-n3-ib"),
        ("x[001,005]", "x001"),
    ],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


def test_detects_slurm_jobset_and_pytorchjob() -> None:
    name, got = detect(
        {
            "SLURM_JOB_ID": "881",
            "SLURM_NNODES": "4",
            "SLURM_NODEID": "2",
            "SLURM_JOB_NODELIST": "n[10-13]",
        }
    )
    assert name == "slurm"
    assert got == {"nnodes": "4", "node_rank": "2", "master_addr": "n10", "run_id": "slurm-881"}
    name, got = detect(
        {"JOBSET_NAME": "llm", "REPLICATED_JOB_NAME": "workers", "JOB_COMPLETION_INDEX": "3"}
    )
    assert name == "kubernetes-jobset"
    assert got == {"master_addr": "llm-workers-0-0.llm", "node_rank": "3", "run_id": "llm"}
    name, got = detect({"PET_NNODES": "2:4", "PET_RDZV_ENDPOINT": "svc:29400", "HOME": "/"})
    assert name == "kubernetes-pytorchjob"
    assert got == {"nnodes": "2:4", "rdzv_endpoint": "svc:29400"}
    assert detect({"HOME": "/root"}) == (None, {})


def test_two_slurm_nodes_form_one_job_from_the_environment(tmp_path: Path) -> None:
    """Two launchers given only SLURM's variables (and a port) agree on sizes and ranks;
    a flag still wins over the environment."""
    port = str(free_port())
    procs = []
    for node in (0, 1):
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "SLURM_", "PET_"))
        }
        env.update(
            SLURM_JOB_ID="4242",
            SLURM_NNODES="2",
            SLURM_NODEID=str(node),
            SLURM_JOB_NODELIST="localhost,localhost",
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "stalwart.cli",
                    "run",
                    "--nproc-per-node",
                    "2",
                    "--master-port",
                    port,
                    "--log-dir",
                    str(tmp_path / f"logs{node}"),
                    str(ENVDUMP),
                    str(tmp_path),
                ],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out[-2000:]
    envs = {r: json.loads((tmp_path / f"env_{r}.json").read_text()) for r in range(4)}
    assert {e["WORLD_SIZE"] for e in envs.values()} == {"4"}
    assert [envs[r]["GROUP_RANK"] for r in range(4)] == ["0", "0", "1", "1"]
    assert {e["MASTER_ADDR"] for e in envs.values()} == {"localhost"}
    assert (tmp_path / "logs0" / "slurm-4242").is_dir()  # the job id names the run
