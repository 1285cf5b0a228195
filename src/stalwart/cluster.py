"""Launch defaults taken from the cluster manager's environment (SLURM, Kubernetes).

Only defaults: a YAML file, ``STALWART_*`` variables and flags all override them.
``PET_<FLAG>`` variables (set by Kubeflow's PyTorchJob, and read by torchrun) are taken
here too, at the same low precedence.
"""

from __future__ import annotations

from collections.abc import Mapping

# torchrun reads PET_<DEST> as the default of each flag: all of them, so that a job
# steered by these variables under torchrun is steered the same way here.
_PET_FIELDS = {
    "NNODES": "nnodes",
    "NPROC_PER_NODE": "nproc_per_node",
    "NODE_RANK": "node_rank",
    "RDZV_BACKEND": "rdzv_backend",
    "RDZV_ENDPOINT": "rdzv_endpoint",
    "RDZV_ID": "run_id",
    "RDZV_CONF": "rdzv_conf",
    "MASTER_ADDR": "master_addr",
    "MASTER_PORT": "master_port",
    "MAX_RESTARTS": "max_restarts",
    "STANDALONE": "standalone",
    "MONITOR_INTERVAL": "monitor_interval",
    "START_METHOD": "start_method",
    "EVENT_LOG_HANDLER": "event_log_handler",
    "ROLE": "role",
    "MODULE": "module",
    "NO_PYTHON": "no_python",
    "RUN_PATH": "run_path",
    "LOG_DIR": "log_dir",
    "REDIRECTS": "redirects",
    "TEE": "tee",
    "LOCAL_RANKS_FILTER": "local_ranks_filter",
    "DUPLICATE_STDOUT_FILTERS": "duplicate_stdout_filters",
    "DUPLICATE_STDERR_FILTERS": "duplicate_stderr_filters",
    "LOCAL_ADDR": "local_addr",
    "SIGNALS_TO_HANDLE": "signals_to_handle",
    "SHUTDOWN_TIMEOUT": "shutdown_timeout",
    "VIRTUAL_LOCAL_RANK": "virtual_local_rank",
}


def first_slurm_host(nodelist: str) -> str:
    """``"gpu[07-09,12],cpu3"`` -> ``"gpu07"``: the first host of a SLURM node list."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    if "[" not in first:
        return first
    prefix, _, rest = first.partition("[")
    inside, _, suffix = rest.partition("]")
    start = inside.split(",")[0].split("-")[0]
    return prefix + start + suffix


def detect(env: Mapping[str, str]) -> tuple[str | None, dict[str, str]]:
    """(name of the environment found, the launch fields it implies)."""
    out: dict[str, str] = {}
    name: str | None = None
    if "SLURM_JOB_ID" in env and ("SLURM_NNODES" in env or "SLURM_JOB_NUM_NODES" in env):
        name = "slurm"
        # Inside an srun step, the step's nodes, which may be fewer than the job's.
        out["nnodes"] = (
            env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or env["SLURM_JOB_NUM_NODES"]
        )
        if "SLURM_NODEID" in env:
            out["node_rank"] = env["SLURM_NODEID"]
        nodelist = (
            env.get("SLURM_STEP_NODELIST")
            or env.get("SLURM_JOB_NODELIST")
            or env.get("SLURM_NODELIST")
        )
        if nodelist:
            out["master_addr"] = first_slurm_host(nodelist)
        out["run_id"] = f"slurm-{env['SLURM_JOB_ID']}"
    elif "JOBSET_NAME" in env and "REPLICATED_JOB_NAME" in env:
        # JobSet: pod i of job j is <jobset>-<rjob>-<j>-<i>.<jobset> (the default subdomain).
        name = "kubernetes-jobset"
        js, rj = env["JOBSET_NAME"], env["REPLICATED_JOB_NAME"]
        out["master_addr"] = f"{js}-{rj}-0-0.{js}"
        if "JOB_COMPLETION_INDEX" in env:
            out["node_rank"] = env["JOB_COMPLETION_INDEX"]
        out["run_id"] = js
    elif "JOB_COMPLETION_INDEX" in env:
        name = "kubernetes-indexed-job"
        out["node_rank"] = env["JOB_COMPLETION_INDEX"]
    pet = {field: env[f"PET_{var}"] for var, field in _PET_FIELDS.items() if f"PET_{var}" in env}
    if pet:
        name = name or "kubernetes-pytorchjob"
        out.update(pet)
    return name, out
