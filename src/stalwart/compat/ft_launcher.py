"""NVIDIA's `fault_tolerance.launcher.get_args_parser()`, for code that parses
`ft_launcher`'s command line itself (a launcher of its own, a test) and builds its
`FaultToleranceConfig` with `FaultToleranceConfig.from_args`.

The parser is `stalwart run`'s (every torchrun option string, stalwart's own flags, the
script and its arguments) plus the `--ft-*` options of the config's fields and
`--ft-cfg-path`. `stalwart run` itself does not take `--ft-*` options: its own flags say
the same (docs/migrating.md, "From NVIDIA's ft_launcher").
"""

from __future__ import annotations

import argparse

from stalwart.config.layers import add_arguments as add_launch_arguments
from stalwart.monitor.ft_config import add_arguments as add_ft_arguments

__all__ = ["get_args_parser", "parse_args"]


def get_args_parser() -> argparse.ArgumentParser:
    """A parser of `ft_launcher`'s command line: stalwart run's flags and `--ft-*`."""
    # No abbreviations: the script's own flags must never be taken for ours.
    parser = argparse.ArgumentParser(
        prog="ft_launcher",
        allow_abbrev=False,
        description="torchrun's options, stalwart's, and NVIDIA's --ft-* settings",
    )
    add_launch_arguments(parser)
    add_ft_arguments(parser)
    return parser


def parse_args(args: list[str] | None) -> argparse.Namespace:
    return get_args_parser().parse_args(args)
