"""Node count, node rank and endpoint taken from SLURM / Kubernetes variables."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from stalwart.cluster import detect, first_slurm_host
from tests.helpers import ROOT, clean_env, free_port, stalwart_argv

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
        env = clean_env(
            SLURM_JOB_ID="4242",
            SLURM_NNODES="2",
            SLURM_NODEID=str(node),
            SLURM_JOB_NODELIST="localhost,localhost",
        )
        procs.append(
            subprocess.Popen(
                stalwart_argv(
                    "--nproc-per-node",
                    "2",
                    "--master-port",
                    port,
                    "--log-dir",
                    tmp_path / f"logs{node}",
                    ENVDUMP,
                    tmp_path,
                ),
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


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:x"], "--rdzv-endpoint 'h:x'"),
        (
            [
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                "https://e:2379",
                "--rdzv-conf",
                "cert=c",
            ],
            "cert and key",
        ),
        (
            ["--rdzv-backend", "etcd", "--rdzv-endpoint", "e:2379", "--rdzv-conf", "password=x"],
            "expected a username",
        ),
        (["--rdzv-backend", "etcd"], "--rdzv-backend etcd: expected --rdzv-endpoint"),
        (["--nnodes", "1:3"], "--nnodes 1:3: an elastic node range needs"),
        (["--rdzv-conf", "is_host=maybe"], "is_host='maybe'"),
        (["--rdzv-conf", "keep_alive_interval=nan"], "keep_alive_interval='nan'"),
        (["--rdzv-conf", "keep_alive_max_attempt=0"], "keep_alive_max_attempt='0'"),
        (["--rdzv-conf", "heartbeat=1"], "--rdzv-conf key 'heartbeat'"),
    ],
)
def test_bad_rendezvous_settings_are_one_line_errors(
    args: list[str], needle: str, tmp_path: Path
) -> None:
    proc = subprocess.run(
        stalwart_argv(*args, "--log-dir", tmp_path, ENVDUMP, tmp_path),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_env(),
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert not any(tmp_path.iterdir())


def test_cluster_node_index_is_ignored_by_a_one_node_launch(tmp_path: Path) -> None:
    """An indexed Job's pod 5 running a one-node job must not be told its rank is out
    of range: the cluster's index only matters to multi-node launches."""
    proc = subprocess.run(
        stalwart_argv("--log-dir", tmp_path / "l", ENVDUMP, tmp_path),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_env(JOB_COMPLETION_INDEX="5"),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "env_0.json").read_text())["GROUP_RANK"] == "0"
