"""What each worker is given: torchrun's environment variables and the command it runs."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from stalwart.base import envvars as ev
from stalwart.config import LaunchConfig
from stalwart.launch.files.logs import WorkerLogs
from stalwart.rendezvous import RendezvousInfo


def worker_env(
    cfg: LaunchConfig, info: RendezvousInfo, local_rank: int, logs: WorkerLogs
) -> dict[str, str]:
    """torchrun's variables, with torchrun's values (checked by a test against torchrun)."""
    rank = info.base_rank + local_rank
    env = {
        ev.LOCAL_RANK: str(local_rank),
        ev.RANK: str(rank),
        ev.GROUP_RANK: str(info.group_rank),
        ev.ROLE_RANK: str(rank),
        ev.ROLE_NAME: cfg.role,
        ev.LOCAL_WORLD_SIZE: str(cfg.nproc_per_node),
        ev.WORLD_SIZE: str(info.world_size),
        ev.GROUP_WORLD_SIZE: str(info.group_world_size),
        ev.ROLE_WORLD_SIZE: str(info.world_size),
        ev.MASTER_ADDR: info.master_addr,
        ev.MASTER_PORT: str(info.master_port),
        ev.RESTART_COUNT: str(info.round),
        ev.MAX_RESTARTS: str(cfg.max_restarts),
        ev.RUN_ID: cfg.run_id,
        # Workers join the per-round store the launcher hosts instead of starting one.
        ev.USE_AGENT_STORE: "True",
        ev.TORCH_NCCL_ASYNC_ERROR_HANDLING: "1",
        ev.SIGNALS_TO_HANDLE: ",".join(cfg.signals_to_handle),
        ev.ERROR_FILE: str(logs.error_file) if logs.error_file else "",
    }
    if cfg.virtual_local_rank:
        env.update(virtual_local_rank(local_rank, os.environ.get(ev.CUDA_VISIBLE_DEVICES)))
    if cfg.inject:
        env[ev.INJECT] = cfg.inject
    if sets_omp_threads(cfg, os.environ):
        env[ev.OMP_NUM_THREADS] = "1"
    return env


def sets_omp_threads(cfg: LaunchConfig, environ: Mapping[str, str]) -> bool:
    """torchrun's rule: more than one worker and no OMP_NUM_THREADS given -> 1 each."""
    return ev.OMP_NUM_THREADS not in environ and cfg.nproc_per_node > 1


# torchrun's warning, word for word: logs are searched for it.
OMP_NOTICE = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, "
    "to avoid your system being overloaded, please further tune the variable for optimal "
    "performance in your application as needed. \n"
    "*****************************************"
)


def virtual_local_rank(local_rank: int, visible: str | None) -> dict[str, str]:
    """torchrun's ``--virtual-local-rank``: every worker is local rank 0 and sees only
    its own GPU, picked from the launcher's ``CUDA_VISIBLE_DEVICES`` when that is set
    (``LaunchConfig`` checked that it names enough)."""
    gpu = str(local_rank) if visible is None else visible.split(",")[local_rank].strip()
    return {ev.LOCAL_RANK: "0", ev.CUDA_VISIBLE_DEVICES: gpu}


def program_argv(cfg: LaunchConfig) -> tuple[str, list[str]]:
    """The program and arguments each worker runs."""
    if cfg.no_python:
        return cfg.entrypoint, list(cfg.args)
    boot = ["-u", "-m", "stalwart.launch.workers.bootstrap"]
    if cfg.module:
        return sys.executable, [*boot, "-m", cfg.entrypoint, *cfg.args]
    return sys.executable, [*boot, cfg.entrypoint, *cfg.args]
