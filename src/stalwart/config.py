"""Every launcher setting as a dataclass, validated once.

Precedence (lowest first): defaults < YAML file (``--config``) < environment
(``STALWART_<FIELD>``) < command-line flags.  The CLI builds a ``LaunchConfig``; nothing
downstream parses strings again.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.launch.logs import DEFAULT_PREFIX, MULTI_NODE_PREFIX, Std
from stalwart.monitor.config import MonitorConfig


class ConfigError(ValueError):
    """A bad setting; the message is one line that names the value and what was expected."""


def parse_nnodes(value: str) -> tuple[int, int]:
    lo, sep, hi = value.partition(":")
    try:
        a = int(lo)
        b = int(hi) if sep else a
    except ValueError:
        raise ConfigError(
            f"--nnodes {value!r}: expected N or MIN:MAX (positive integers)"
        ) from None
    if a < 1 or b < a:
        raise ConfigError(f"--nnodes {value!r}: expected 1 <= MIN <= MAX")
    return a, b


def parse_nproc(value: str) -> int:
    if value in ("auto", "cpu"):
        return os.cpu_count() or 1
    if value == "gpu":
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise ConfigError("--nproc-per-node gpu: no CUDA device is visible on this node")
        return n
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(
            f"--nproc-per-node {value!r}: expected a positive integer, auto, cpu or gpu"
        ) from None
    if n < 1:
        raise ConfigError(f"--nproc-per-node {value!r}: expected a positive integer")
    return n


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def parse_size(value: str | int, flag: str) -> int:
    """``"512MiB"``, ``"2G"``, ``"1.5GiB"`` or a byte count -> bytes (K/M/G alone are binary)."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        text = str(value).strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        number_text, unit = digits, text[len(digits) :]
        try:
            number = float(number_text)
        except ValueError:
            number = -1.0
    if unit not in _SIZE_UNITS or not 0 <= number < float("inf"):
        raise ConfigError(f"{flag} {value!r}: expected a size such as 512MiB, 2GiB or 0 (off)")
    return int(number * _SIZE_UNITS[unit])


def parse_kv(value: str, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in value.split(","))):
        k, eq, v = item.partition("=")
        if not eq or not k:
            raise ConfigError(f"{flag} {value!r}: expected key=value[,key=value...]")
        out[k.strip()] = v.strip()
    return out


@dataclass
class LaunchConfig:
    """What ``stalwart run`` was asked to do."""

    entrypoint: str
    args: list[str] = field(default_factory=list)
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    node_rank: int | None = 0
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    run_id: str = ""
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    master_addr: str = ""  # "": localhost for one node, 127.0.0.1 for several (as torchrun)
    master_port: int = 29500
    local_addr: str = ""  # address peers use to reach this node ("": the route to the store)
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: Path | None = None
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    local_ranks_filter: set[int] | None = None
    log_line_prefix_template: str = ""  # "": torchrun's, or with the host for several nodes
    role: str = "default"
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    shutdown_timeout: float = 30.0
    inject: str = ""
    standalone: bool = False
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    warm: bool = True
    restart_policy: str = "any-failed"
    preload: list[str] = field(default_factory=list)
    # Bytes of launcher-owned memory per local rank and snapshot (two are kept); 0: off.
    ckpt_ram: int = 0
    # Peer nodes that hold a replica of each node's snapshots; None: 1 with >= 2 nodes.
    ckpt_replicas: int | None = None
    metrics_port: int = 0  # 0: no /metrics endpoint
    metrics_addr: str = "0.0.0.0"

    def __post_init__(self) -> None:
        if self.run_id in ("", "none"):
            # One node can pick its own id; several must share one, as with torchrun.
            self.run_id = uuid.uuid4().hex[:12] if self.max_nodes == 1 else "none"
        if not self.log_line_prefix_template:
            self.log_line_prefix_template = (
                MULTI_NODE_PREFIX if self.max_nodes > 1 else DEFAULT_PREFIX
            )
        self.validate()

    @property
    def nnodes(self) -> int:
        return self.max_nodes

    @property
    def effective_master_addr(self) -> str:
        if self.master_addr:
            return self.master_addr
        return "localhost" if self.max_nodes == 1 else "127.0.0.1"

    def validate(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port {self.metrics_port}: expected a port, 1..65535")
        if self.module and self.no_python:
            raise ConfigError("--module and --no-python cannot be used together")
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise ConfigError(
                f"--rdzv-backend {self.rdzv_backend!r}: expected one of {', '.join(RDZV_BACKENDS)}"
            )
        if self.min_nodes != self.max_nodes and self.rdzv_backend == "static":
            raise ConfigError(
                f"--nnodes {self.min_nodes}:{self.max_nodes}: an elastic node range needs "
                "--rdzv-backend c10d or etcd (static membership is a fixed count)"
            )
        if self.rdzv_backend == "etcd" and not self.rdzv_endpoint:
            raise ConfigError(
                "--rdzv-backend etcd: expected --rdzv-endpoint HOST:PORT[,HOST:PORT...] "
                "of the etcd cluster"
            )
        if self.rdzv_endpoint:
            # Imported here: the rendezvous package imports this module.
            from stalwart.rendezvous.c10d import StoreEndpoint
            from stalwart.rendezvous.etcd import access_from_conf, parse_endpoints

            try:
                if self.rdzv_backend == "etcd":
                    ports = [port for _, port in parse_endpoints(self.rdzv_endpoint)]
                    lowest = 1
                    access_from_conf(self.rdzv_conf, self.rdzv_endpoint)
                else:
                    ports = [StoreEndpoint.parse(self.rdzv_endpoint).port]
                    lowest = 0  # 0: the host picks a free port (--standalone)
            except ValueError as err:
                raise ConfigError(str(err)) from None
            for port in ports:
                if not lowest <= port <= 65535:
                    raise ConfigError(
                        f"--rdzv-endpoint {self.rdzv_endpoint!r}: port {port} is not a TCP "
                        f"port (expected {lowest}..65535)"
                    )
        is_host = self.rdzv_conf.get("is_host")
        if is_host is not None and is_host.lower() not in ("0", "1", "true", "false", "yes", "no"):
            raise ConfigError(f"--rdzv-conf is_host={is_host!r}: expected 1 or 0")
        if self.ckpt_ram < 0:
            raise ConfigError(f"--ckpt-ram {self.ckpt_ram}: expected a size >= 0")
        if self.ckpt_replicas is not None and self.ckpt_replicas < 0:
            raise ConfigError(f"--ckpt-replicas {self.ckpt_replicas}: expected a count >= 0")
        if self.ckpt_replicas and not self.ckpt_ram:
            raise ConfigError(
                f"--ckpt-replicas {self.ckpt_replicas}: replicas copy RAM snapshots, "
                "so it needs --ckpt-ram SIZE"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: expected >= 0")
        # Bounded: waits longer than the platform's timer maximum raise OverflowError deep
        # in a thread, and nan compares false with everything (a grace that never ends).
        if not 0 < self.monitor_interval <= MAX_MONITOR_INTERVAL:
            raise ConfigError(
                f"--monitor-interval {self.monitor_interval}: expected seconds > 0 and "
                f"<= {MAX_MONITOR_INTERVAL:g}"
            )
        if not 0 <= self.shutdown_timeout <= MAX_SHUTDOWN_TIMEOUT:
            raise ConfigError(
                f"--shutdown-timeout {self.shutdown_timeout}: expected seconds >= 0 and "
                f"<= {MAX_SHUTDOWN_TIMEOUT:g}"
            )
        if not _RUN_ID.fullmatch(self.run_id):
            raise ConfigError(
                f"--rdzv-id {self.run_id!r}: expected letters, digits and . _ - @ + : "
                "(up to 128, not starting with . or -; it names the run's folder)"
            )
        limit, why = max_local_workers()
        if self.nproc_per_node > limit:
            raise ConfigError(
                f"--nproc-per-node {self.nproc_per_node}: more workers than this machine "
                f"can run (at most {limit}: {why})"
            )
        if self.log_dir is not None:
            check_log_dir(self.log_dir)
        if self.no_python:
            problem = _program_problem(self.entrypoint)
            if problem:
                raise ConfigError(f"--no-python {self.entrypoint!r}: {problem}")
        if self.start_method not in ("spawn", "fork", "forkserver"):
            raise ConfigError(
                f"--start-method {self.start_method!r}: expected spawn, fork or forkserver"
            )
        if self.restart_policy not in RESTART_POLICIES:
            raise ConfigError(
                f"--restart-policy {self.restart_policy!r}: expected one of "
                f"{', '.join(RESTART_POLICIES)}"
            )
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank}: expected 0 <= node rank < nnodes ({self.nnodes})"
            )
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port {self.master_port}: expected 1..65535")
        for key in self.rdzv_conf:
            if key not in RDZV_CONF_KEYS:
                raise ConfigError(
                    f"--rdzv-conf key {key!r}: expected one of {', '.join(sorted(RDZV_CONF_KEYS))}"
                )
        for key in ("join_timeout", "last_call_timeout", "close_timeout", "keep_alive_interval"):
            self.rdzv_seconds(key)
        raw = self.rdzv_conf.get("keep_alive_max_attempt", "3")
        if not raw.isdigit() or int(raw) < 1:
            raise ConfigError(
                f"--rdzv-conf keep_alive_max_attempt={raw!r}: expected an integer >= 1"
            )
        if self.inject:
            from stalwart import inject

            try:
                inject.parse(self.inject)
            except ValueError as err:
                raise ConfigError(str(err)) from None

    @property
    def join_timeout(self) -> float:
        return self.rdzv_seconds("join_timeout")

    def rdzv_seconds(self, key: str) -> float:
        """A positive duration from ``--rdzv-conf`` (torch's defaults where absent)."""
        raw = self.rdzv_conf.get(key, RDZV_DEFAULTS[key])
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"--rdzv-conf {key}={raw!r}: expected seconds") from None
        if not 0 < value < float("inf"):  # also refuses nan
            raise ConfigError(f"--rdzv-conf {key}={raw!r}: expected a finite number > 0 of seconds")
        return value


MAX_MONITOR_INTERVAL = 3600.0
MAX_SHUTDOWN_TIMEOUT = 7 * 86400.0
_RUN_ID = re.compile(r"[A-Za-z0-9_@+:][A-Za-z0-9._@+:-]{0,127}")
# A bare interpreter with the launcher's environment needs tens of MiB; a torch worker
# hundreds.  The floor keeps a typo (99999) from making 99,999 folders and processes.
_WORKER_MEMORY = 64 << 20


def max_local_workers() -> tuple[int, str]:
    """How many workers this machine could start at all, and why that many."""
    import resource

    import psutil

    mem = psutil.virtual_memory().total
    limit = max(1, mem // _WORKER_MEMORY)
    why = f"{mem / (1 << 30):.0f} GiB of memory at {_WORKER_MEMORY >> 20} MiB per worker"
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and soft < limit:
        limit, why = max(1, soft), f"the process limit RLIMIT_NPROC is {soft}"
    return int(limit), why


def _program_problem(program: str) -> str:
    """Why *program* cannot be executed ("" when it can), as ``execvp`` would find it."""
    if os.sep not in program:
        return "" if shutil.which(program) else "no such program on PATH"
    path = Path(program)
    if not path.exists():
        return "no such file"
    if path.is_dir():
        return "is a folder, expected an executable program"
    if not os.access(path, os.X_OK):
        return "not executable (chmod +x, or run it through its interpreter)"
    return ""


def check_log_dir(path: Path) -> None:
    """A one-line error now rather than a traceback when the run folder is made."""
    if str(path) == os.devnull:
        return
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"--log-dir {str(path)!r}: {str(probe)!r} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"--log-dir {str(path)!r}: {str(probe)!r} is not writable")


# any-failed: torchrun's rule, any worker failure restarts every worker.
# all-failed: for jobs under stalwart.inprocess.Wrapper, whose survivors carry on without
# a rank that left; processes restart only when every worker ended and none completed.
RESTART_POLICIES = ("any-failed", "all-failed")

RDZV_BACKENDS = ("static", "c10d", "etcd")
RDZV_DEFAULTS = {
    "join_timeout": "600",
    "last_call_timeout": "30",
    "close_timeout": "30",
    "keep_alive_interval": "5",
    "keep_alive_max_attempt": "3",
    "read_timeout": "60",
}
# is_host: c10d; the others reach etcd (``rendezvous/etcd.py``: ACCESS_KEYS).
RDZV_CONF_KEYS = {
    *RDZV_DEFAULTS,
    "is_host",
    *("protocol", "cacert", "cert", "key", "username", "password", "password_file"),
}


def env_overrides(prefix: str = "STALWART_") -> dict[str, str]:
    """``STALWART_MAX_RESTARTS=3`` -> ``{"max_restarts": "3"}`` for known fields."""
    names = set(LaunchConfig.__dataclass_fields__)
    out = {}
    for key, value in os.environ.items():
        if key.startswith(prefix):
            name = key[len(prefix) :].lower()
            if name in names and name not in ("entrypoint", "args", "monitor", "preload"):
                out[name] = value
    return out


def load_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        # YAML's messages span lines (with a caret under the problem): one line here.
        raise ConfigError(
            f"--config {path}: cannot read YAML ({' '.join(str(err).split())})"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings at the top level")
    return {str(k).replace("-", "_"): v for k, v in data.items()}
