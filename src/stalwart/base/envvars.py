"""Names of the environment variables the launcher sets for its workers, and of those
it reads itself.

Spelled here only: the launcher writes them and the worker side (bootstrap, runlog,
in-process restart, checkpoints) reads them, all importing the names from this module.
The hang monitor's own variables are in ``stalwart.monitor.envvars``.
"""

from __future__ import annotations

# -- torchrun's worker environment, with torchrun's names and meanings ---------------------
LOCAL_RANK = "LOCAL_RANK"
RANK = "RANK"
GROUP_RANK = "GROUP_RANK"
ROLE_RANK = "ROLE_RANK"
ROLE_NAME = "ROLE_NAME"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
WORLD_SIZE = "WORLD_SIZE"
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
#: The attempt (round) number, from 0.
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
RUN_ID = "TORCHELASTIC_RUN_ID"
#: "True": the launcher hosts the round's store and workers connect to it as clients.
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
TORCH_NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
#: Where a worker writes its uncaught exception (``error.json``, torchrun's format).
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
#: "1": torch's file timer is in use (torchrun sets the pipe only then).
ENABLE_FILE_TIMER = "TORCHELASTIC_ENABLE_FILE_TIMER"
OMP_NUM_THREADS = "OMP_NUM_THREADS"
#: Set per worker only with ``--virtual-local-rank`` (its one GPU), as torchrun.
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"

# -- stalwart's own -----------------------------------------------------------------------
#: The launcher's pid: a worker's parent-death signal names it.
LAUNCHER_PID = "STALWART_LAUNCHER_PID"
#: A random token per run, in every process of the job, so the guardian can find them.
RUN_TOKEN = "STALWART_RUN_TOKEN"
#: "0", "false" or "no": the launcher does not give the job a cgroup of its own.
CGROUP = "STALWART_CGROUP"
#: Fault-injection plan (``--inject``).
INJECT = "STALWART_INJECT"
#: A file (mode 0600, in the launcher's private folder) holding the key workers seal
#: their in-process records with; the job's secret itself never reaches a worker.
WORKER_KEY_FILE = "STALWART_WORKER_KEY_FILE"
#: "0": workers do not count optimizer steps as training steps (``--no-auto-progress``).
AUTO_PROGRESS = "STALWART_AUTO_PROGRESS"

# -- other programs' knobs ----------------------------------------------------------------
#: setproctitle: leave the environment block alone when setting the title.
SPT_NOENV = "SPT_NOENV"
