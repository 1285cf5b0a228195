"""``stalwart run | report``: flags -> config objects, nothing else.

``stalwart run`` accepts torchrun's command line (``s/torchrun/stalwart run/`` works) and
adds stalwart's own flags.  Bad values end the program with one line naming them.
"""

from __future__ import annotations

# Only the standard library at module level: ``main`` holds termination signals first
# thing, and everything imported before that is a window where a Ctrl-C prints a
# traceback.  The rest is imported where it is used.
import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from stalwart.launch import signals

if TYPE_CHECKING:
    from stalwart.config import LaunchConfig
    from stalwart.monitor.config import MonitorConfig


def _flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, **kw: Any) -> None:
    """Adds ``--a-b`` with torchrun's ``--a_b`` spelling as an alias."""
    names = [name]
    if "-" in name[2:]:
        names.append("--" + name[2:].replace("-", "_"))
    parser.add_argument(*names, **kw)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the flag and value (not the whole
    usage, which buries it), with a pointer to --help; exit status 2 as argparse's."""

    def error(self, message: str) -> NoReturn:
        from stalwart.config import ConfigError

        raise ConfigError(f"{message} (see '{self.prog} --help')")


def run_parser() -> argparse.ArgumentParser:
    from stalwart.launch.logs import DEFAULT_PREFIX, MULTI_NODE_PREFIX

    # No abbreviations: the script's own flags (``--out``) must never be taken for ours.
    p = _Parser(
        allow_abbrev=False,
        prog="stalwart run",
        description="Launch and supervise a distributed PyTorch job (a drop-in torchrun).",
    )
    _flag(p, "--nnodes", default=None, help="N or MIN:MAX nodes (default 1)")
    _flag(p, "--nproc-per-node", default=None, help="workers per node: N, auto, cpu or gpu")
    _flag(p, "--node-rank", type=int, default=None, help="this node's rank (static rendezvous)")
    p.add_argument("--standalone", action="store_true", help="single node, private rendezvous")
    _flag(p, "--rdzv-backend", default=None, help="static, c10d or etcd")
    _flag(p, "--rdzv-endpoint", default=None, help="HOST[:PORT] of the rendezvous store")
    _flag(p, "--rdzv-id", default=None, help="job id shared by all nodes")
    _flag(p, "--rdzv-conf", default=None, help="key=value,... (join_timeout, is_host)")
    _flag(p, "--master-addr", default=None)
    _flag(p, "--master-port", type=int, default=None)
    _flag(p, "--local-addr", default=None, help="address other nodes use to reach this one")
    _flag(p, "--max-restarts", type=int, default=None)
    _flag(p, "--monitor-interval", type=float, default=None, help="seconds between checks")
    _flag(p, "--start-method", default=None, choices=["spawn", "fork", "forkserver"])
    _flag(p, "--log-dir", default=None)
    p.add_argument("-r", "--redirects", default=None, help="0..3 or map like 0:3,1:0")
    p.add_argument("-t", "--tee", default=None, help="0..3 or map like 0:3,1:0")
    _flag(p, "--local-ranks-filter", default=None, help="local ranks shown on the console")
    _flag(
        p,
        "--log-line-prefix-template",
        default=None,
        help=f"default {DEFAULT_PREFIX!r}; {MULTI_NODE_PREFIX!r} for several nodes",
    )
    p.add_argument("--role", default=None)
    p.add_argument("-m", "--module", action="store_true", help="run the entrypoint as a module")
    _flag(p, "--no-python", action="store_true", help="run the entrypoint as a program")
    _flag(p, "--run-path", action="store_true", help="accepted for torchrun compatibility")
    _flag(p, "--shutdown-timeout", type=float, default=None, help="TERM -> KILL grace, seconds")
    _flag(
        p,
        "--restart-policy",
        default=None,
        help="any-failed (default, as torchrun) or all-failed (for stalwart.inprocess jobs)",
    )
    _flag(p, "--no-warm", action="store_true", help="start every worker cold (no template)")
    _flag(
        p,
        "--ckpt-ram",
        default=None,
        help="memory per local rank for checkpoint snapshots that survive a worker restart "
        "(e.g. 2GiB; two snapshots are kept; default 0: off)",
    )
    _flag(
        p,
        "--ckpt-replicas",
        default=None,
        help="peer nodes that keep a copy of each node's RAM snapshots, for a node loss "
        "(default 1 with 2 or more nodes)",
    )
    p.add_argument(
        "--preload", default=None, help="modules the warm template imports, e.g. numpy,mylib"
    )
    p.add_argument("--inject", default=None, help="fault spec, e.g. crash:rank=1,step=30")
    p.add_argument("--config", type=Path, default=None, help="YAML file of settings")
    _flag(p, "--metrics-port", default=None, help="serve Prometheus /metrics on this port")
    _flag(p, "--metrics-addr", default=None, help="address for --metrics-port (0.0.0.0)")
    hang = p.add_argument_group("hang detection (see docs/monitor.md)")
    _flag(hang, "--hb-timeout", default=None, help="max seconds between heartbeats, or auto")
    _flag(hang, "--hb-initial-timeout", default=None, help="max seconds to the first heartbeat")
    _flag(
        hang,
        "--section-timeout",
        action="append",
        default=None,
        metavar="NAME=SECS",
        help="max seconds a named section may stay open (repeatable); auto learns the others",
    )
    _flag(
        hang,
        "--out-of-section-timeout",
        default=None,
        help="max seconds with no section open, or auto",
    )
    _flag(hang, "--safety-factor", default=None, help="learned timeout = max observed x this")
    _flag(hang, "--hang-signal", default=None, help="signal sent to a hung rank (default TERM)")
    _flag(hang, "--stack-dump-wait", default=None, help="seconds to let a hung rank dump stacks")
    _flag(hang, "--auto-warmup-steps", default=None, help="heartbeats seen before auto applies")
    _flag(hang, "--auto-warmup-seconds", default=None, help="seconds seen before auto applies")
    _flag(hang, "--auto-percentile", default=None, help="observed interval auto uses (100=max)")
    _flag(hang, "--auto-floor", default=None, help="shortest timeout auto may learn (seconds)")
    _flag(hang, "--straggler-factor", default=None, help="slower than the others by this: named")
    _flag(hang, "--straggler-window", default=None, help="seconds each straggler verdict spans")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("entrypoint", help="script, module (-m) or program (--no-python)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


TORCH_PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


def _merge(ns: argparse.Namespace) -> dict[str, Any]:
    """defaults < cluster (SLURM, Kubernetes) < YAML < torchrun's environment <
    STALWART_* environment < flags."""
    from stalwart import cluster
    from stalwart.config import env_overrides, load_yaml

    merged: dict[str, Any] = dict(cluster.detect(os.environ)[1])
    if ns.config is not None:
        merged.update(load_yaml(ns.config))
    # torchrun (2.13) reads its prefix template only from this variable; an empty value
    # is unset there too.  Our own STALWART_ variable and the flag are more specific.
    torch_prefix = os.environ.get(TORCH_PREFIX_ENV)
    if torch_prefix:
        merged["log_line_prefix_template"] = torch_prefix
    merged.update(env_overrides())
    flags = {
        "nnodes": ns.nnodes,
        "nproc_per_node": ns.nproc_per_node,
        "node_rank": ns.node_rank,
        "rdzv_backend": ns.rdzv_backend,
        "rdzv_endpoint": ns.rdzv_endpoint,
        "run_id": ns.rdzv_id,
        "rdzv_conf": ns.rdzv_conf,
        "master_addr": ns.master_addr,
        "master_port": ns.master_port,
        "local_addr": ns.local_addr,
        "max_restarts": ns.max_restarts,
        "monitor_interval": ns.monitor_interval,
        "start_method": ns.start_method,
        "log_dir": ns.log_dir,
        "redirects": ns.redirects,
        "tee": ns.tee,
        "local_ranks_filter": ns.local_ranks_filter,
        "log_line_prefix_template": ns.log_line_prefix_template,
        "role": ns.role,
        "shutdown_timeout": ns.shutdown_timeout,
        "restart_policy": ns.restart_policy,
        "ckpt_ram": ns.ckpt_ram,
        "ckpt_replicas": ns.ckpt_replicas,
        "metrics_port": ns.metrics_port,
        "metrics_addr": ns.metrics_addr,
        "inject": ns.inject if ns.inject is not None else os.environ.get("STALWART_INJECT"),
    }
    merged.update({k: v for k, v in flags.items() if v is not None})
    return merged


_MONITOR_FLAGS = {
    "hb_timeout": "hb_timeout",
    "hb_initial_timeout": "hb_initial_timeout",
    "section_timeout": "section_timeouts",
    "out_of_section_timeout": "out_of_section_timeout",
    "safety_factor": "safety_factor",
    "hang_signal": "term_signal",
    "stack_dump_wait": "stack_dump_wait",
    "auto_warmup_steps": "auto_warmup_steps",
    "auto_warmup_seconds": "auto_warmup_seconds",
    "auto_percentile": "auto_percentile",
    "auto_floor": "auto_floor",
    "straggler_factor": "straggler_factor",
    "straggler_window": "straggler_window",
}


def _monitor_config(ns: argparse.Namespace, merged: dict[str, Any]) -> MonitorConfig:
    """defaults < YAML ``monitor:`` mapping < ``STALWART_HB_TIMEOUT``-style env < flags."""
    from stalwart.config import ConfigError
    from stalwart.monitor.config import MonitorConfig

    data: dict[str, Any] = {}
    yaml_part = merged.get("monitor") or {}
    if not isinstance(yaml_part, dict):
        raise ConfigError("--config: 'monitor' must be a mapping of hang-detection settings")
    data.update({str(k).replace("-", "_"): v for k, v in yaml_part.items()})
    for flag, key in _MONITOR_FLAGS.items():
        env = os.environ.get("STALWART_" + flag.upper())
        if env is not None:
            data[key] = env
    for flag, key in _MONITOR_FLAGS.items():
        value = getattr(ns, flag)
        if value is not None:
            data[key] = value
    if "monitor_interval" in merged:
        data.setdefault("check_interval", merged["monitor_interval"])
    try:
        return MonitorConfig.from_mapping(data)
    except ValueError as err:
        raise ConfigError(f"hang detection: {err}") from None


def _typed(name: str, value: Any, conv: type) -> Any:
    from stalwart.config import ConfigError

    try:
        return conv(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} {value!r}: expected {conv.__name__}") from None


def build_config(argv: list[str]) -> tuple[LaunchConfig, bool]:
    from stalwart.config import (
        ConfigError,
        LaunchConfig,
        parse_kv,
        parse_nnodes,
        parse_nproc,
        parse_size,
    )
    from stalwart.launch.logs import parse_ranks_filter, parse_std

    ns = run_parser().parse_args(argv)
    m = _merge(ns)
    min_nodes, max_nodes = parse_nnodes(str(m.get("nnodes", "1")))
    kw: dict[str, Any] = {
        "entrypoint": ns.entrypoint,
        "args": list(ns.args),
        "min_nodes": min_nodes,
        "max_nodes": max_nodes,
        "nproc_per_node": parse_nproc(str(m.get("nproc_per_node", "1"))),
        "module": ns.module,
        "no_python": ns.no_python,
        "run_path": ns.run_path,
        "standalone": ns.standalone,
    }
    if ns.args and ns.args[0] == "--":
        kw["args"] = ns.args[1:]
    for name, conv in (
        ("master_port", int),
        ("max_restarts", int),
        ("monitor_interval", float),
        ("shutdown_timeout", float),
        ("metrics_port", int),
        ("ckpt_replicas", int),
    ):
        if name in m:
            kw[name] = _typed("--" + name.replace("_", "-"), m[name], conv)
    for name in (
        "rdzv_backend",
        "rdzv_endpoint",
        "master_addr",
        "local_addr",
        "start_method",
        "role",
        "inject",
        "log_line_prefix_template",
        "restart_policy",
        "metrics_addr",
    ):
        if name in m:
            kw[name] = str(m[name])
    if "run_id" in m:
        kw["run_id"] = str(m["run_id"])
    if "node_rank" in m:
        kw["node_rank"] = _typed("--node-rank", m["node_rank"], int)
    if "rdzv_conf" in m:
        raw = m["rdzv_conf"]
        kw["rdzv_conf"] = (
            {str(k): str(v) for k, v in raw.items()}
            if isinstance(raw, dict)
            else parse_kv(str(raw), "--rdzv-conf")
        )
    if "log_dir" in m:
        kw["log_dir"] = Path(str(m["log_dir"]))
    if "ckpt_ram" in m:
        kw["ckpt_ram"] = parse_size(m["ckpt_ram"], "--ckpt-ram")
    try:
        for name in ("redirects", "tee"):
            if name in m:
                kw[name] = parse_std(str(m[name]), "--" + name)
        if "local_ranks_filter" in m:
            kw["local_ranks_filter"] = parse_ranks_filter(str(m["local_ranks_filter"]))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if (ns.standalone or max_nodes == 1) and ns.node_rank is None:
        # A cluster's node index (a SLURM step, an indexed Job) means nothing to a
        # one-node launch: each such launcher is a job of its own.
        kw.pop("node_rank", None)
    if ns.standalone:
        kw.update(rdzv_backend="c10d", rdzv_endpoint="localhost:0", min_nodes=1, max_nodes=1)
        kw.setdefault("run_id", "none")
    elif max_nodes > 1 and kw.get("rdzv_backend", "static") != "static" and "node_rank" not in m:
        kw["node_rank"] = None  # assigned by the rendezvous in order of arrival
    kw["monitor"] = _monitor_config(ns, m)
    if ns.no_warm or str(m.get("warm", "true")).lower() in ("0", "false", "no"):
        kw["warm"] = False
    preload = ns.preload if ns.preload is not None else m.get("preload")
    if preload:
        kw["preload"] = (
            [str(x) for x in preload]
            if isinstance(preload, list)
            else [x.strip() for x in str(preload).split(",") if x.strip()]
        )
    return LaunchConfig(**kw), ns.verbose


def _quiet_torch_import(verbose: bool) -> None:
    """The launcher reports store errors in one line of its own; torch's C++ layer would
    add a stack trace per connection retry.  The level is read when torch loads, so it is
    set for the import and restored at once: workers inherit the user's setting."""
    import warnings

    # Import-time chatter of torch and its optional packages, not the launcher's business.
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    if verbose or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch.distributed  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def cmd_run(argv: list[str]) -> int:
    import logging

    from stalwart.config import ConfigError

    try:
        cfg, verbose = build_config(argv)
    except ConfigError as err:
        print(f"stalwart run: error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="[stalwart %(levelname)s %(asctime)s] %(message)s",
        stream=sys.stderr,
    )
    from stalwart.launch.runfiles import RunFolderError
    from stalwart.launch.supervisor import Supervisor
    from stalwart.rendezvous import RendezvousError

    try:
        sup = Supervisor(cfg)
    except RunFolderError as err:
        print(f"stalwart run: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the run folder: checked already, but the disk may be full
        print(f"stalwart run: error: --log-dir {cfg.log_dir}: {err.strerror}", file=sys.stderr)
        return 2
    except ConfigError as err:  # e.g. the metrics port is taken
        print(f"stalwart run: error: {err}", file=sys.stderr)
        return 2
    if signals.pending() is None:  # else run() goes straight to its shutdown
        sup.prestart()  # the warm template imports while this process imports torch
        _quiet_torch_import(verbose)
    try:
        result = sup.run()
    except RendezvousError as err:
        print(f"stalwart run: error: {err}", file=sys.stderr)
        return 3
    except ConfigError as err:  # found at setup, e.g. no room for --ckpt-ram
        print(f"stalwart run: error: {err}", file=sys.stderr)
        return 2
    return result.exit_code


def cmd_report(argv: list[str]) -> int:
    from stalwart.launch.report import report_main

    code: int = report_main(argv)
    return code


def main(argv: list[str] | None = None) -> int:
    signals.hold()
    argv = sys.argv[1:] if argv is None else argv
    commands = {"run": cmd_run, "report": cmd_report}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(
            "usage: stalwart {run,report} ...\n"
            "  run     launch and supervise a job (torchrun's flags, plus --inject,\n"
            "          --shutdown-timeout, --config)\n"
            "  report  summarise a run folder's events.jsonl",
            file=sys.stderr,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] != "run":
        # Only ``run`` shuts down through the supervisor; elsewhere a signal acts as usual.
        import signal

        for sig in signals.FORWARDED:
            signal.signal(
                sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            )
        held = signals.pending()
        if held is not None:
            return 128 + held
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
