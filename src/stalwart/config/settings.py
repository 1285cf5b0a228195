"""Every launcher setting, declared once: a `LaunchConfig` field with its `Flag` beside it
(`flags.py` says how a flag is declared, parsed and checked).

A field's `Flag` (its dataclass metadata) carries all of the setting's spellings: the
command-line names (torchrun's, each ``--a-b`` also as ``--a_b``), the help text, the
parser from text (or a YAML value), the ``STALWART_<KEY>`` environment name and the YAML
key.  ``config.layers`` derives the argparse parser, the precedence merge and the typed
values from these declarations; the fields are in ``--help`` order.  Hang detection's
flags are declared in `flags.HANG_FLAGS`: their values make the monitor's own ``MonitorConfig``,
which `config.hang` parses from text once and the command line hands in here.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart.config.endpoints import Endpoint, parse_endpoint, parse_endpoints
from stalwart.config.flags import (
    A_FLOAT,
    AN_INT,
    HANG_FLAGS,
    HANG_GROUP,
    INT,
    as_given,
    checked,
    filters_flag,
    flag,
    one_line,
    one_of,
    setting,
    switch_flag,
)
from stalwart.config.host import check_log_dir, max_local_workers, program_problem
from stalwart.config.output import (
    DEFAULT_PREFIX,
    Std,
    parse_ranks_filter,
    parse_std,
)
from stalwart.config.rdzv import EtcdAccessConf, RendezvousConf, etcd_access
from stalwart.config.secret import job_secret, launcher_secret
from stalwart.config.values import (
    ConfigError,
    is_false,
    parse_exception_names,
    parse_list,
    parse_nnodes,
    parse_nproc,
    parse_quarantine_after,
    parse_quarantine_for,
    parse_signals,
    parse_size,
)

if TYPE_CHECKING:
    from stalwart.monitor.config import MonitorConfig

MAX_MONITOR_INTERVAL = 3600.0
MAX_SHUTDOWN_TIMEOUT = 7 * 86400.0
_RUN_ID = re.compile(r"[A-Za-z0-9_@+:][A-Za-z0-9._@+:-]{0,127}")


# any-failed: torchrun's rule, any worker failure restarts every worker.
# all-failed: for jobs under stalwart.inprocess.Wrapper, whose survivors carry on without
# a rank that left; processes restart only when every worker ended and none completed.
RESTART_POLICIES = ("any-failed", "all-failed")

RDZV_BACKENDS = ("static", "c10d", "etcd")
START_METHODS = ("spawn", "fork", "forkserver")
# torchrun's: its workers' TORCHELASTIC_SIGNALS_TO_HANDLE, and what the launcher forwards.
SIGNALS_TO_HANDLE = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# torch.distributed.elastic.events' registered handlers; stalwart's event log is
# events.jsonl whichever is named (torchrun's default, "null", writes nothing).
EVENT_LOG_HANDLERS = ("null", "console", "dynamic_rendezvous")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What ``stalwart run`` was asked to do, each value parsed and checked once."""

    entrypoint: str = setting(
        MISSING,
        flag(
            "entrypoint", env=False, yaml=False, help="script, module (-m) or program (--no-python)"
        ),
    )
    args: list[str] = setting(
        factory=list, f=flag("args", env=False, yaml=False, nargs="...", parse=as_given)
    )
    # The argparse dest and YAML key are "nnodes": the property below is the job's size.
    # No STALWART_NNODES: stalwart never read one (SLURM's and PET_NNODES come as the
    # cluster's layer).
    node_range: tuple[int, int] = setting(
        (1, 1),
        flag(
            "--nnodes",
            env=False,
            target="node_range",
            help="N or MIN:MAX nodes (default 1)",
            parse=lambda v, _n: parse_nnodes(str(v)),
        ),
    )
    nproc_per_node: int = setting(
        1,
        flag(
            "--nproc-per-node",
            help="workers per node: N, auto, cpu or gpu",
            parse=lambda v, _n: parse_nproc(str(v)),
        ),
    )
    node_rank: int | None = setting(
        0,
        flag("--node-rank", **AN_INT, help="this node's rank (static rendezvous)"),
    )
    standalone: bool = setting(
        False,
        switch_flag("--standalone", help="single node, private rendezvous"),
    )
    rdzv_backend: str = setting(
        "static",
        flag(
            "--rdzv-backend",
            help="static, c10d or etcd",
            check=one_of(RDZV_BACKENDS),
        ),
    )
    rdzv_endpoint: str = setting(
        "", flag("--rdzv-endpoint", help="HOST[:PORT] of the rendezvous store")
    )
    run_id: str = setting(
        "",
        flag(
            "--rdzv-id",
            key="run_id",
            help="job id shared by all nodes",
            check=checked(
                lambda r: _RUN_ID.fullmatch(r) is not None,
                "expected letters, digits and . _ - @ + : "
                "(up to 128, not starting with . or -; it names the run's folder)",
            ),
        ),
    )
    rdzv_conf: RendezvousConf = setting(
        factory=RendezvousConf,
        f=flag(
            "--rdzv-conf",
            help="key=value,... (join_timeout, is_host)",
            parse=lambda v, _n: RendezvousConf.parse(v),
        ),
    )
    # "": localhost for one node, 127.0.0.1 for several (as torchrun)
    master_addr: str = setting("", flag("--master-addr"))
    master_port: int = setting(
        29500,
        flag(
            "--master-port",
            **AN_INT,
            check=checked(lambda p: 0 < p < 65536, "expected 1..65535"),
        ),
    )
    # The address peers use to reach this node ("": the route to the store).
    local_addr: str = setting(
        "", flag("--local-addr", help="address other nodes use to reach this one")
    )
    max_restarts: int = setting(
        0,
        flag(
            "--max-restarts",
            **AN_INT,
            check=checked(lambda n: n >= 0, "expected >= 0"),
        ),
    )
    # The crash-loop verdict (``launch.round.restart_policy``): restarts that cannot help.
    max_no_progress_attempts: int = setting(
        3,
        flag(
            "--max-no-progress-attempts",
            **AN_INT,
            help="stop without restart once this many attempts in a row end with the same "
            "error (same rank, exception or exit code) and get no further (default 3; 0: "
            "never)",
            check=checked(lambda n: 0 <= n <= 1_000_000, "expected a count >= 0"),
        ),
    )
    stop_on: tuple[str, ...] = setting(
        (),
        flag(
            "--stop-on",
            parse=parse_exception_names,
            help="exception types that stop the job at once when a rank raises one before "
            "its first step, e.g. ImportError,SyntaxError (default: none)",
        ),
    )
    no_requeue_exit_code: int = setting(
        93,
        flag(
            "--no-requeue-exit-code",
            **AN_INT,
            help="the launcher's exit code when it stops a crash loop: the job should not "
            "be requeued (default 93, as NVIDIA's ft_launcher)",
            check=checked(
                lambda c: 2 <= c <= 125 and c != 3,
                "expected 2..125, other than 3 (a rendezvous error)",
            ),
        ),
    )
    monitor_interval: float = setting(
        0.1,
        flag(
            "--monitor-interval",
            **A_FLOAT,
            help="seconds between checks",
            # Bounded: waits longer than the platform's timer maximum raise OverflowError
            # deep in a thread, and nan compares false with everything.
            check=checked(
                lambda s: 0 < s <= MAX_MONITOR_INTERVAL,
                f"expected seconds > 0 and <= {MAX_MONITOR_INTERVAL:g}",
            ),
        ),
    )
    start_method: str = setting(
        "spawn",
        flag(
            "--start-method",
            choices=START_METHODS,
            check=checked(lambda m: m in START_METHODS, "expected spawn, fork or forkserver"),
        ),
    )
    log_dir: Path | None = setting(None, flag("--log-dir", parse=lambda v, _n: Path(str(v))))
    redirects: Std | dict[int, Std] = setting(
        Std.NONE,
        flag("-r", "--redirects", parse=one_line(parse_std), help="0..3 or map like 0:3,1:0"),
    )
    tee: Std | dict[int, Std] = setting(
        Std.NONE,
        flag("-t", "--tee", parse=one_line(parse_std), help="0..3 or map like 0:3,1:0"),
    )
    local_ranks_filter: set[int] | None = setting(
        None,
        flag(
            "--local-ranks-filter",
            parse=one_line(lambda v, _n: parse_ranks_filter(v)),
            help="local ranks shown on the console",
        ),
    )
    log_line_prefix_template: str = setting(
        DEFAULT_PREFIX,
        flag(
            "--log-line-prefix-template",
            torch_env="TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
            help=f"console prefix of worker lines (default {DEFAULT_PREFIX!r}, as torchrun)",
        ),
    )
    role: str = setting("default", flag("--role"))
    module: bool = setting(
        False,
        switch_flag("-m", "--module", help="run the entrypoint as a module"),
    )
    no_python: bool = setting(
        False,
        switch_flag("--no-python", help="run the entrypoint as a program"),
    )
    run_path: bool = setting(
        False,
        switch_flag("--run-path", help="accepted for torchrun compatibility"),
    )
    # torchrun's flags below.  Those stalwart cannot honour accept torchrun's default and
    # refuse anything else (rather than ignore it): docs/migrating.md says why.
    signals_to_handle: tuple[str, ...] = setting(
        SIGNALS_TO_HANDLE,
        flag(
            "--signals-to-handle",
            parse=lambda v, n: parse_signals(v if isinstance(v, str) else ",".join(v), n),
            help="signals forwarded to the workers, e.g. SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 "
            "(TERM, INT, HUP and QUIT are always handled)",
        ),
    )
    virtual_local_rank: bool = setting(
        False,
        switch_flag(
            "--virtual-local-rank",
            help="LOCAL_RANK=0 in every worker, CUDA_VISIBLE_DEVICES its one GPU",
        ),
    )
    event_log_handler: str = setting(
        "null",
        flag(
            "--event-log-handler",
            help="accepted for torchrun compatibility; events go to events.jsonl",
            check=one_of(EVENT_LOG_HANDLERS),
        ),
    )
    logs_specs: str = setting(
        "",
        flag(
            "--logs-specs",
            help="only 'default': stalwart writes one log layout",
            check=checked(
                lambda s: s in ("", "default"),
                "expected default (stalwart writes one log layout: --log-dir, -r, -t)",
            ),
        ),
    )
    numa_binding: str = setting(
        "",
        flag(
            "--numa-binding",
            help="not supported (GPU affinity); refused",
            check=checked(
                lambda s: s == "",
                "not supported by stalwart run (it binds workers near their GPUs); "
                "wrap the program with numactl and --no-python instead",
            ),
        ),
    )
    duplicate_stdout_filters: list[str] = setting(
        factory=list,
        f=filters_flag("stdout"),
    )
    duplicate_stderr_filters: list[str] = setting(
        factory=list,
        f=filters_flag("stderr"),
    )
    shutdown_timeout: float = setting(
        30.0,
        flag(
            "--shutdown-timeout",
            **A_FLOAT,
            torch_env="TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
            help="TERM -> KILL grace, seconds",
            check=checked(
                lambda s: 0 <= s <= MAX_SHUTDOWN_TIMEOUT,
                f"expected seconds >= 0 and <= {MAX_SHUTDOWN_TIMEOUT:g}",
            ),
        ),
    )
    # Workers stopped because a worker failed (here or on another node) have nothing to
    # finish: their state comes back from the last checkpoint.  A short bound keeps one
    # that cannot act on SIGTERM (blocked in a collective with a dead peer) from holding
    # every restart for the whole --shutdown-timeout, which stays the bound on any grace.
    survivor_grace: float = setting(
        5.0,
        flag(
            "--survivor-grace",
            **A_FLOAT,
            help="SIGTERM -> SIGKILL grace, seconds, for workers stopped because another "
            "worker failed (at most --shutdown-timeout)",
            check=checked(
                lambda s: 0 <= s <= MAX_SHUTDOWN_TIMEOUT,
                f"expected seconds >= 0 and <= {MAX_SHUTDOWN_TIMEOUT:g}",
            ),
        ),
    )
    restart_policy: str = setting(
        "any-failed",
        flag(
            "--restart-policy",
            help="any-failed (default, as torchrun) or all-failed (for stalwart.inprocess jobs)",
            check=one_of(RESTART_POLICIES),
        ),
    )
    # The flag turns it off; YAML ``warm: false`` and STALWART_WARM=0 too.
    warm: bool = setting(
        True,
        flag(
            "--no-warm",
            key="warm",
            action="store_const",
            const=False,
            parse=lambda v, _n: not is_false(v),
            help="start every worker cold (no template)",
        ),
    )
    # Bytes of launcher-owned memory per local rank and snapshot (two are kept); 0: off.
    ckpt_ram: int = setting(
        0,
        flag(
            "--ckpt-ram",
            parse=parse_size,
            help="memory per local rank for checkpoint snapshots that survive a worker "
            "restart (e.g. 2GiB; two snapshots are kept; default 0: off)",
            check=checked(lambda n: n >= 0, "expected a size >= 0"),
        ),
    )
    # Peer nodes that hold a replica of each node's snapshots; None: 1 with >= 2 nodes.
    ckpt_replicas: int | None = setting(
        None,
        flag(
            "--ckpt-replicas",
            **AN_INT,
            help="peer nodes that keep a copy of each node's RAM snapshots, for a node loss "
            "(default 1 with 2 or more nodes)",
            check=checked(lambda n: n is None or n >= 0, "expected a count >= 0"),
        ),
    )
    # The secret itself may come as STALWART_JOB_SECRET instead (config/secret.py).
    job_secret_file: Path | None = setting(
        None,
        flag(
            "--job-secret-file",
            parse=lambda v, _n: Path(str(v)),
            help="file holding the secret every node of the job shares (RAM replicas "
            "between nodes need it; or set STALWART_JOB_SECRET)",
        ),
    )
    # Node health checks before each round (stalwart.health; docs/health.md).
    node_health: bool = setting(
        False,
        flag(
            "--node-health",
            action="store_const",
            const=True,
            parse=lambda v, _n: not is_false(v),
            help="check each node before every round (compute, memory, disk, interface, "
            "links to its peers) and keep a failing node out of it",
        ),
    )
    node_health_check: str = setting(
        "",
        flag(
            "--node-health-check",
            help="your own node check, run before every round (implies --node-health): "
            "exit 0 passes; else the first line of its output says why "
            '(e.g. {"reason": "GPU 3 clock low"})',
        ),
    )
    node_health_timeout: float = setting(
        30.0,
        flag(
            "--node-health-timeout",
            **A_FLOAT,
            help="seconds --node-health-check may take before it is killed and fails",
            check=checked(lambda s: 0 < s <= 3600, "expected seconds > 0 and <= 3600"),
        ),
    )
    node_health_wait: float = setting(
        60.0,
        flag(
            "--node-health-wait",
            **A_FLOAT,
            help="seconds a round waits for the health report of a node that joined it; "
            'a node silent that long is kept out ("no health report within Ns")',
            check=checked(lambda s: 0 < s <= 3600, "expected seconds > 0 and <= 3600"),
        ),
    )
    node_health_min_free: int = setting(
        256 * 2**20,
        flag(
            "--node-health-min-free",
            parse=parse_size,
            help="memory available and disk free in the log folder a node needs to pass "
            "its health check (default 256MiB)",
            check=checked(lambda n: n >= 0, "expected a size >= 0"),
        ),
    )
    # Quarantine (health/quarantine.py).  3 of the last 5: three is the count after which
    # NVIDIA's ft_launcher stops a job that makes no progress and this launcher stops a
    # crash loop (--max-no-progress-attempts), and a window of 5 lets one or two
    # failures elsewhere in between not reset it.  Needs the job secret on multi-node
    # jobs (the ledger is signed); rounds of a single node blame nobody.
    quarantine_after: tuple[int, int] | None = setting(
        (3, 5),
        flag(
            "--quarantine-after",
            parse=one_line(lambda v, _n: parse_quarantine_after(v)),
            help="keep a node out of later rounds once it is implicated (root cause, hang "
            "root, straggler, lost) in K of the job's last M failed rounds: K/M (default "
            "3/5), or off",
        ),
    )
    # Never by default: a node that failed K of M rounds of this job is likely to fail
    # the next (a bad GPU or link does not heal within a job; NVIDIA's launcher and
    # DLRover likewise keep an excluded node out until the job is requeued).
    quarantine_for: float | None = setting(
        None,
        flag(
            "--quarantine-for",
            parse=one_line(lambda v, _n: parse_quarantine_for(v)),
            help="seconds until a quarantined node may rejoin, or never (default never: the "
            "rest of the job)",
        ),
    )
    # YAML or the flag only (no variable was ever read for it).
    preload: list[str] = setting(
        factory=list,
        f=flag(
            "--preload",
            env=False,
            parse=lambda v, _n: parse_list(v),
            help="modules the warm template imports, e.g. numpy,mylib",
        ),
    )
    # Checked by the command line: the spec is ``stalwart.inject``'s language.
    inject: str = setting("", flag("--inject", help="fault spec, e.g. crash:rank=1,step=30"))
    config_file: Path | None = setting(
        None,
        flag(
            "--config",
            target="config_file",
            env=False,
            yaml=False,
            argtype=Path,
            parse=lambda v, _n: Path(str(v)),
            help="YAML file of settings",
        ),
    )
    metrics_port: int = setting(
        0,  # 0: no /metrics endpoint
        flag(
            "--metrics-port",
            parse=INT,
            help="serve Prometheus /metrics on this port",
            check=checked(lambda p: 0 <= p <= 65535, "expected a port, 1..65535"),
        ),
    )
    metrics_addr: str = setting(
        "0.0.0.0", flag("--metrics-addr", help="address for --metrics-port (0.0.0.0)")
    )
    # Hang detection: the HANG_FLAGS group, built into the monitor's own record.
    monitor: MonitorConfig = field(metadata={"group": (HANG_GROUP, HANG_FLAGS)})
    verbose: bool = setting(
        False,
        switch_flag("-v", "--verbose"),
    )
    # Derived once from the fields above (by __post_init__).
    store_endpoints: tuple[Endpoint, ...] = field(init=False, default=())
    etcd_access: EtcdAccessConf | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.run_id in ("", "none"):
            # One node can pick its own id; several must share one, as with torchrun.
            self._set("run_id", uuid.uuid4().hex[:12] if self.max_nodes == 1 else "none")
        if not self.log_line_prefix_template:
            self._set("log_line_prefix_template", DEFAULT_PREFIX)
        self.validate()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: only while being made

    @property
    def min_nodes(self) -> int:
        return self.node_range[0]

    @property
    def max_nodes(self) -> int:
        return self.node_range[1]

    @property
    def nnodes(self) -> int:
        return self.max_nodes

    @property
    def effective_master_addr(self) -> str:
        if self.master_addr:
            return self.master_addr
        return "localhost" if self.max_nodes == 1 else "127.0.0.1"

    @property
    def health_checks(self) -> bool:
        return self.node_health or bool(self.node_health_check)

    def _check_health_across_nodes(self) -> None:
        flag_ = "--node-health-check" if self.node_health_check else "--node-health"
        if self.node_health_check and self.node_health_wait <= self.node_health_timeout:
            raise ConfigError(
                f"--node-health-wait {self.node_health_wait:g}: expected more seconds than "
                f"--node-health-timeout {self.node_health_timeout:g} (a node's report comes "
                "after its check)"
            )
        if self.rdzv_backend == "static" or not self.rdzv_endpoint:
            raise ConfigError(
                f"{flag_} with --nnodes {self.max_nodes}: expected --rdzv-backend c10d or "
                "etcd with an endpoint (a node kept out needs a round that can close "
                "without it)"
            )
        if job_secret(self.job_secret_file, os.environ) is None:
            raise ConfigError(
                f"{flag_} across nodes signs each node's report with the job secret: set "
                "STALWART_JOB_SECRET or --job-secret-file (the same on every node)"
            )

    @property
    def join_timeout(self) -> float:
        return self.rdzv_conf.join_timeout

    def validate(self) -> None:
        """Each field's own check (declared with its flag), then the rules between fields."""
        for f in fields(self):
            declared = f.metadata.get("flag")
            problem = declared.problem(getattr(self, f.name)) if declared else ""
            if problem:
                raise ConfigError(problem)
        if self.module and self.no_python:
            raise ConfigError("--module and --no-python cannot be used together")
        if self.min_nodes != self.max_nodes and self.rdzv_backend == "static":
            raise ConfigError(
                f"--nnodes {self.min_nodes}:{self.max_nodes}: an elastic node range needs "
                "--rdzv-backend c10d or etcd (static membership is a fixed count)"
            )
        if self.ckpt_replicas and not self.ckpt_ram:
            raise ConfigError(
                f"--ckpt-replicas {self.ckpt_replicas}: replicas copy RAM snapshots, "
                "so it needs --ckpt-ram SIZE"
            )
        if self.ckpt_ram and self.max_nodes >= 2 and self.ckpt_replicas != 0:
            launcher_secret(self.job_secret_file, os.environ, multi_node=True)
        if self.health_checks and self.max_nodes > 1:
            self._check_health_across_nodes()
        if self.monitor.straggler_restart and self.min_nodes == self.max_nodes:
            raise ConfigError(
                f"--straggler-restart with --nnodes {self.max_nodes}: expected an elastic "
                "--nnodes MIN:MAX (a job of fixed membership cannot go on without a node)"
            )
        if self.rdzv_backend == "etcd" and not self.rdzv_endpoint:
            raise ConfigError(
                "--rdzv-backend etcd: expected --rdzv-endpoint HOST:PORT[,HOST:PORT...] "
                "of the etcd cluster"
            )
        if self.rdzv_endpoint:
            self._endpoints()
        limit, why = max_local_workers()
        if self.nproc_per_node > limit:
            raise ConfigError(
                f"--nproc-per-node {self.nproc_per_node}: more workers than this machine "
                f"can run (at most {limit}: {why})"
            )
        if self.log_dir is not None:
            check_log_dir(self.log_dir)
        if self.no_python:
            problem = program_problem(self.entrypoint)
            if problem:
                raise ConfigError(f"--no-python {self.entrypoint!r}: {problem}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank}: expected 0 <= node rank < nnodes ({self.nnodes})"
            )

    def _endpoints(self) -> None:
        """Parses ``--rdzv-endpoint`` once for the backend (and etcd's access with it)."""
        try:
            if self.rdzv_backend == "etcd":
                endpoints = tuple(parse_endpoints(self.rdzv_endpoint))
                lowest = 1
                access = etcd_access(self.rdzv_conf, self.rdzv_endpoint)
                access.tls_context()  # unreadable TLS files: said now, not at the first join
                self._set("etcd_access", access)
            else:
                # A static job's endpoint defaults to --master-port, c10d's to torchrun's.
                port = self.master_port if self.rdzv_backend == "static" else None
                endpoints = (
                    parse_endpoint(self.rdzv_endpoint)
                    if port is None
                    else parse_endpoint(self.rdzv_endpoint, port),
                )
                lowest = 0  # 0: the host picks a free port (--standalone)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        for _, port in endpoints:
            if not lowest <= port <= 65535:
                raise ConfigError(
                    f"--rdzv-endpoint {self.rdzv_endpoint!r}: port {port} is not a TCP "
                    f"port (expected {lowest}..65535)"
                )
        self._set("store_endpoints", endpoints)
