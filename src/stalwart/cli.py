"""``stalwart run | report``: flags -> config objects, nothing else.

``stalwart run`` accepts torchrun's command line (``s/torchrun/stalwart run/`` works) and
adds stalwart's own flags.  Bad values end the program with one line naming them.
"""

from __future__ import annotations

# Only the standard library at module level: ``main`` holds termination signals first
# thing, and everything imported before that is a window where a Ctrl-C prints a
# traceback.  The rest is imported where it is used.
import argparse
import gc
import os
import sys
from typing import TYPE_CHECKING, NoReturn

from stalwart.launch.round import signals

if TYPE_CHECKING:
    from stalwart.config import LaunchConfig


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the flag and value (not the whole
    usage, which buries it), with a pointer to --help; exit status 2 as argparse's."""

    def error(self, message: str) -> NoReturn:
        from stalwart.config import ConfigError

        raise ConfigError(f"{message} (see '{self.prog} --help')")


def run_parser() -> argparse.ArgumentParser:
    """``stalwart run``'s flags, as ``stalwart.config`` declares them."""
    from stalwart.config.layers import add_arguments

    # No abbreviations: the script's own flags (``--out``) must never be taken for ours.
    p = _Parser(
        allow_abbrev=False,
        prog="stalwart run",
        description="Launch and supervise a distributed PyTorch job (a drop-in torchrun).",
    )
    add_arguments(p)
    return p


def _check_visible_devices(cfg: LaunchConfig, visible: str | None) -> None:
    """``--virtual-local-rank`` gives each worker one entry of CUDA_VISIBLE_DEVICES."""
    from stalwart.config import ConfigError

    few = visible is not None and len(visible.split(",")) < cfg.nproc_per_node
    if cfg.virtual_local_rank and few:
        raise ConfigError(
            f"--virtual-local-rank with --nproc-per-node {cfg.nproc_per_node}: "
            f"CUDA_VISIBLE_DEVICES={visible!r} names fewer GPUs than workers"
        )


def build_config(argv: list[str]) -> tuple[LaunchConfig, bool]:
    """argv, the environment, the ``--config`` file and the cluster -> the settings
    (and whether to log verbosely); the reading happens here, the rules in config."""
    from stalwart import cluster, inject
    from stalwart.base import envvars as ev
    from stalwart.config import ConfigError, LaunchConfig, hang, layers

    ns = run_parser().parse_args(argv)
    given = layers.from_namespace(vars(ns))
    yaml = layers.load_yaml(ns.config) if ns.config is not None else {}
    torch_env, our_env = layers.from_environment(os.environ)
    merged = layers.merge(
        cluster.detect(os.environ)[1], layers.from_yaml(yaml), torch_env, our_env, given
    )
    kw = layers.launch_kwargs(merged, given)
    monitor = hang.monitor_config(layers.monitor_settings(yaml, os.environ, given, merged))
    cfg = LaunchConfig(monitor=monitor, **kw)
    _check_visible_devices(cfg, os.environ.get(ev.CUDA_VISIBLE_DEVICES))
    if cfg.inject:
        try:
            inject.parse(cfg.inject)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    return cfg, cfg.verbose


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
    from stalwart.launch.files.runfiles import RunFolderError
    from stalwart.launch.round.supervisor import Supervisor
    from stalwart.launch.workers.environment import OMP_NOTICE, sets_omp_threads

    if sets_omp_threads(cfg, os.environ):
        print(OMP_NOTICE, file=sys.stderr, flush=True)
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
        # torch's objects live until the launcher exits: kept out of the cyclic GC, they
        # cost no collection pauses, and no final collection at exit (about 1 s with
        # torch loaded on 2 busy cores: see bench/bench_launcher_exit.py).
        gc.freeze()
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
    from stalwart.reporting.report import report_main

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
