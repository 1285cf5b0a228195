"""From the declarations to values: the argparse parser, the layers and their precedence.

Precedence, lowest first: defaults < cluster (SLURM, Kubernetes) < YAML (``--config``) <
torchrun's environment < ``STALWART_<KEY>`` environment < flags.  Each layer is a mapping
from a `Flag`'s key to the value as given; `launch_kwargs` turns the merged mapping into
`LaunchConfig`'s typed fields and `monitor_settings` into the monitor's mapping.  The
caller reads the files and the environment: everything here is a function of its inputs.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from stalwart.base.yamlfile import read_yaml
from stalwart.config.flags import HANG_FLAGS, Flag
from stalwart.config.settings import LaunchConfig
from stalwart.config.values import ConfigError


def launch_flags() -> list[Flag]:
    """`LaunchConfig`'s flags in ``--help`` order (the hang group not among them)."""
    return [f.metadata["flag"] for f in fields(LaunchConfig) if "flag" in f.metadata]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every declared flag, in ``--help`` order, with its help and torchrun's spellings."""
    for f in fields(LaunchConfig):
        if "flag" in f.metadata:
            _add(parser, f.metadata["flag"])
        elif "group" in f.metadata:
            title, flags = f.metadata["group"]
            group = parser.add_argument_group(title)
            for one in flags:
                _add(group, one)


def _add(parser: argparse.ArgumentParser | argparse._ArgumentGroup, f: Flag) -> None:
    kw: dict[str, Any] = {"help": f.help}
    if f.positional:
        if f.nargs is not None:
            kw["nargs"] = f.nargs
        parser.add_argument(f.key, **kw)
        return
    # None: not given, so a lower layer's value stands.
    kw.update(dest=f.key, default=None)
    if f.action is not None:
        kw["action"] = f.action
        if f.action == "store_const":
            kw["const"] = f.const
    if f.action in (None, "append"):
        if f.argtype is not None:
            kw["type"] = f.argtype
        if f.choices is not None:
            kw["choices"] = list(f.choices)
        else:  # argparse's own, from the first long spelling (the dest may differ)
            kw["metavar"] = f.metavar or f.flag.lstrip("-").replace("-", "_").upper()
    parser.add_argument(*f.spellings, **kw)


def _all_flags() -> list[Flag]:
    return [*launch_flags(), *HANG_FLAGS]


def from_namespace(ns: Mapping[str, Any]) -> dict[str, Any]:
    """What the command line gave (argparse's namespace as a mapping)."""
    return {f.key: ns[f.key] for f in _all_flags() if ns.get(f.key) is not None}


def from_environment(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(torchrun's variables, ``STALWART_<KEY>`` variables): two layers, the second higher."""
    flags = _all_flags()
    # torchrun reads an empty value as unset; so does this.
    torch = {f.key: environ[f.torch_env] for f in flags if f.torch_env and environ.get(f.torch_env)}
    ours = {f.key: environ[f.env] for f in flags if f.env is not None and f.env in environ}
    return torch, ours


def yaml_keys() -> dict[str, Flag]:
    """The top-level YAML keys and the flag each sets: the setting's key, and torchrun's
    name for it where that differs (``rdzv_id`` for ``run_id``).  Switches that turn a
    setting off (``--no-warm``) keep their one key: ``no_warm: true`` would read backwards."""
    out: dict[str, Flag] = {}
    for f in launch_flags():
        if not f.yaml:
            continue
        out[f.key] = f
        if f.action is None:
            out.setdefault(f.flag.lstrip("-").replace("-", "_"), f)
    return out


def from_yaml(data: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level keys a YAML file may set (null: not set).  A key that sets nothing is
    an error naming it, so a misspelt or misplaced setting never passes silently."""
    known = yaml_keys()
    unknown = sorted(k for k in data if k not in known and k != "monitor")
    if unknown:
        hang = {f.key for f in HANG_FLAGS} | {f.sets for f in HANG_FLAGS}
        where = (
            " (hang-detection settings go under 'monitor:')"
            if any(k in hang for k in unknown)
            else ""
        )
        raise ConfigError(
            f"--config: unknown key {unknown[0]!r}{where}; expected one of "
            f"{', '.join(sorted([*known, 'monitor']))}"
        )
    out: dict[str, Any] = {}
    spelt: dict[str, str] = {}
    for name, value in data.items():
        if name == "monitor" or value is None:
            continue
        f = known[name]
        if f.key in out and out[f.key] != value:
            raise ConfigError(
                f"--config: {spelt[f.key]!r} and {name!r} set the same setting "
                f"to different values ({out[f.key]!r}, {value!r}); expected one of them"
            )
        out[f.key], spelt[f.key] = value, name
    return out


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win."""
    out: dict[str, Any] = {}
    for layer in layers:
        out.update(layer)
    return out


def launch_kwargs(merged: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """`LaunchConfig`'s fields from the merged layers (*given*: the command line's alone),
    with torchrun's rules for ``--standalone`` and node ranks."""
    kw: dict[str, Any] = {}
    for f in launch_flags():
        if f.key in merged:
            kw[f.sets] = f.value(merged[f.key])
    args = kw.get("args", [])
    if args and args[0] == "--":
        kw["args"] = args[1:]
    one_node = kw.get("node_range", (1, 1))[1] == 1
    standalone = kw.get("standalone", False)
    if (standalone or one_node) and "node_rank" not in given:
        # A cluster's node index (a SLURM step, an indexed Job) means nothing to a
        # one-node launch: each such launcher is a job of its own.
        kw.pop("node_rank", None)
    if standalone:
        kw.update(rdzv_backend="c10d", rdzv_endpoint="localhost:0", node_range=(1, 1))
        kw.setdefault("run_id", "none")
    elif not one_node and kw.get("rdzv_backend", "static") != "static" and "node_rank" not in kw:
        kw["node_rank"] = None  # assigned by the rendezvous in order of arrival
    return kw


def monitor_settings(
    yaml: Mapping[str, Any],
    environ: Mapping[str, str],
    given: Mapping[str, Any],
    merged: Mapping[str, Any],
) -> dict[str, Any]:
    """The monitor's settings, keyed by ``MonitorConfig``'s names: YAML's ``monitor:``
    mapping < ``STALWART_HB_TIMEOUT``-style variables < flags (a flag's list of sections
    replaces the YAML mapping as a whole)."""
    part = yaml.get("monitor") or {}
    if not isinstance(part, Mapping):
        raise ConfigError("--config: 'monitor' must be a mapping of hang-detection settings")
    data: dict[str, Any] = {str(k).replace("-", "_"): v for k, v in part.items()}
    for f in HANG_FLAGS:
        if f.env is not None and f.env in environ:
            data[f.sets] = environ[f.env]
    for f in HANG_FLAGS:
        if f.key in given:
            data[f.sets] = f.value(given[f.key])
    if "monitor_interval" in merged:
        data.setdefault("check_interval", merged["monitor_interval"])
    return data


def load_yaml(path: Path) -> dict[str, Any]:
    """A ``--config`` file's settings, keys with ``-`` read as ``_`` (the file bounded as
    ``stalwart.base.yamlfile`` says)."""
    try:
        data = read_yaml(path)
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read ({err.strerror or err})") from None
    except ValueError as err:
        raise ConfigError(f"--config {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {path}: expected a mapping of settings at the top level, "
            f"got {type(data).__name__}"
        )
    return {str(k).replace("-", "_"): v for k, v in data.items()}
