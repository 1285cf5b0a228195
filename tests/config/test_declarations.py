"""Each setting declared once: the parser, the environment names, the YAML keys and the
layers are derived from `LaunchConfig`'s flags; config and rendezvous import nothing above."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from stalwart.cli import build_config, run_parser
from stalwart.config import HANG_FLAGS, ConfigError, LaunchConfig, Std, launch_flags
from stalwart.config import layers as L

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _loaded_after(statement: str) -> list[str]:
    code = (
        f"{statement}; import sys; "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('stalwart'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_rendezvous_api_loads_only_the_rendezvous_package() -> None:
    loaded = _loaded_after("import stalwart.rendezvous.api")
    assert "stalwart.rendezvous.api" in loaded
    # The base layer (process primitives, liveness) sits below every package.
    allowed = ("stalwart.rendezvous", "stalwart.base")
    assert all(m == "stalwart" or m.startswith(allowed) for m in loaded), loaded


def test_config_loads_no_other_stalwart_package() -> None:
    loaded = _loaded_after("import stalwart.config")
    assert "stalwart.config.settings" in loaded
    # The base layer (the bounded --config reader) sits below every package.
    allowed = ("stalwart.config", "stalwart.base")
    assert all(m == "stalwart" or m.startswith(allowed) for m in loaded), loaded


def _all_flags() -> list[Any]:
    return [*launch_flags(), *HANG_FLAGS]


def test_every_spelling_env_name_and_key_is_declared_once() -> None:
    flags = _all_flags()
    spellings = [s for f in flags for s in f.spellings]
    assert len(spellings) == len(set(spellings))
    envs = [f.env for f in flags if f.env is not None]
    assert len(envs) == len(set(envs))
    keys = [f.key for f in flags]
    assert len(keys) == len(set(keys))
    # Every field is either declared with its flag, the hang group, or derived from them.
    for f in fields(LaunchConfig):
        assert "flag" in f.metadata or "group" in f.metadata or not f.init, f.name


# flag -> (STALWART_ variable, YAML key or None, the LaunchConfig field it sets)
_SPELLED = [
    ("--nnodes", None, "nnodes", "node_range"),
    ("--nproc-per-node", "STALWART_NPROC_PER_NODE", "nproc_per_node", "nproc_per_node"),
    ("--rdzv-id", "STALWART_RUN_ID", "run_id", "run_id"),
    ("--rdzv-conf", "STALWART_RDZV_CONF", "rdzv_conf", "rdzv_conf"),
    ("--max-restarts", "STALWART_MAX_RESTARTS", "max_restarts", "max_restarts"),
    ("--no-warm", "STALWART_WARM", "warm", "warm"),
    ("--preload", None, "preload", "preload"),
    ("--inject", "STALWART_INJECT", "inject", "inject"),
    ("--standalone", None, None, "standalone"),
    ("--module", None, None, "module"),
    ("--config", None, None, "config_file"),
]


@pytest.mark.parametrize(("name", "env", "yaml", "target"), _SPELLED)
def test_declared_names(name: str, env: str | None, yaml: str | None, target: str) -> None:
    (f,) = [f for f in launch_flags() if name in f.spellings]
    assert f.env == env
    assert (f.key if f.yaml else None) == yaml
    assert f.sets == target


# Hang detection: flag -> (variable, MonitorConfig key)
_HANG = [
    ("--hb-timeout", "STALWART_HB_TIMEOUT", "hb_timeout"),
    ("--section-timeout", "STALWART_SECTION_TIMEOUT", "section_timeouts"),
    ("--hang-signal", "STALWART_HANG_SIGNAL", "term_signal"),
    ("--straggler-window", "STALWART_STRAGGLER_WINDOW", "straggler_window"),
]


@pytest.mark.parametrize(("name", "env", "key"), _HANG)
def test_hang_flags_name_monitor_keys(name: str, env: str, key: str) -> None:
    (f,) = [f for f in HANG_FLAGS if name in f.spellings]
    assert (f.env, f.sets) == (env, key)


# torchrun's spellings, both forms where torchrun has both.
_TORCHRUN = [
    ["--nproc_per_node", "2"],
    ["--nproc-per-node", "2"],
    ["--node_rank", "0"],
    ["--rdzv_backend", "static"],
    ["--rdzv_endpoint", "h:1"],
    ["--rdzv_id", "job"],
    ["--rdzv_conf", "join_timeout=5"],
    ["--master_addr", "h"],
    ["--master_port", "1234"],
    ["--local_addr", "h"],
    ["--max_restarts", "1"],
    ["--monitor_interval", "0.5"],
    ["--start_method", "fork"],
    ["--log_dir", "/tmp"],
    ["--local_ranks_filter", "0"],
    ["--log_line_prefix_template", "x"],
    ["--no_python"],
    ["--run_path"],
    ["-r", "3"],
    ["-t", "3"],
    ["-m"],
    ["--standalone"],
    ["--role", "r"],
]


@pytest.mark.parametrize("argv", _TORCHRUN, ids=lambda a: a[0])
def test_torchrun_spellings_parse(argv: list[str]) -> None:
    ns = run_parser().parse_args([*argv, "train.py"])
    given = L.from_namespace(vars(ns))
    assert len(set(given) - {"entrypoint", "args"}) == 1, given


def test_help_shows_both_spellings_and_the_declared_help() -> None:
    text = run_parser().format_help()
    for f in _all_flags():
        if f.positional:
            continue
        for spelling in f.spellings:
            assert spelling in text
        if f.help:
            assert " ".join(f.help.split()[:3]) in " ".join(text.split())


def _kwargs(*layers: dict[str, Any], given: dict[str, Any] | None = None) -> dict[str, Any]:
    given = {"entrypoint": "x.py", **(given or {})}
    return L.launch_kwargs(L.merge(*layers, given), given)


# (cluster, yaml, torchrun's env, STALWART_ env, flags) -> the value that wins
_PRECEDENCE = [
    ({"max_restarts": "1"}, {}, {}, {}, {}, 1),
    ({"max_restarts": "1"}, {"max_restarts": 2}, {}, {}, {}, 2),
    ({}, {"max_restarts": 2}, {}, {"max_restarts": "3"}, {}, 3),
    ({}, {"max_restarts": 2}, {}, {"max_restarts": "3"}, {"max_restarts": 4}, 4),
]


@pytest.mark.parametrize(("cluster", "yaml", "torch", "ours", "flags", "want"), _PRECEDENCE)
def test_precedence_table(
    cluster: dict[str, Any],
    yaml: dict[str, Any],
    torch: dict[str, Any],
    ours: dict[str, Any],
    flags: dict[str, Any],
    want: int,
) -> None:
    kw = _kwargs(cluster, L.from_yaml(yaml), torch, ours, given=flags)
    assert kw["max_restarts"] == want


def test_environment_layers_are_read_from_the_declarations() -> None:
    environ = {
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "te:",
        "STALWART_INJECT": "crash:rank=0,step=1",
        "STALWART_NNODES": "4",  # not a variable of stalwart's (as before)
        "STALWART_HB_TIMEOUT": "5",
        "STALWART_WARM": "0",
    }
    torch, ours = L.from_environment(environ)
    assert torch == {"log_line_prefix_template": "te:"}
    assert ours == {"inject": "crash:rank=0,step=1", "hb_timeout": "5", "warm": "0"}
    assert L.from_environment({"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": ""})[0] == {}


# (flags given, merged layers beneath) -> (node_range, node_rank, backend) after the rules
_RULES = [
    ({}, {}, ((1, 1), None, None)),  # node_rank absent: the field's default (0)
    ({}, {"node_rank": "5"}, ((1, 1), None, None)),  # a cluster index, one node: ignored
    ({"node_rank": 0}, {}, ((1, 1), 0, None)),
    ({"standalone": True}, {"nnodes": "2"}, ((1, 1), None, "c10d")),
    ({"nnodes": "2", "rdzv_backend": "c10d"}, {}, ((2, 2), "auto", "c10d")),
    ({"nnodes": "2", "rdzv_backend": "c10d"}, {"node_rank": "1"}, ((2, 2), 1, "c10d")),
    ({"nnodes": "2"}, {}, ((2, 2), None, None)),  # static: the field's default (0)
]


@pytest.mark.parametrize(("given", "below", "want"), _RULES)
def test_standalone_and_node_rank_rules(
    given: dict[str, Any], below: dict[str, Any], want: tuple[Any, Any, Any]
) -> None:
    kw = _kwargs(below, given=given)
    node_range, node_rank, backend = want
    assert kw.get("node_range", (1, 1)) == node_range
    if node_rank == "auto":
        assert "node_rank" in kw and kw["node_rank"] is None
    elif node_rank is None:
        assert "node_rank" not in kw
    else:
        assert kw["node_rank"] == node_rank
    assert kw.get("rdzv_backend") == backend


def test_config_is_frozen_and_typed() -> None:
    cfg, _ = build_config(["--nnodes", "1:2", "--rdzv-backend", "c10d", "-t", "3", "x.py"])
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nnodes) == (1, 2, 2)
    assert cfg.tee == Std.ALL
    assert cfg.store_endpoints == ()
    with pytest.raises(AttributeError):
        cfg.max_restarts = 3  # type: ignore[misc]


def test_yaml_null_leaves_the_default() -> None:
    assert L.from_yaml({"max_restarts": None, "role": "x"}) == {"role": "x"}


def test_usage_error_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--max-restarts/--max_restarts: invalid int"):
        run_parser().parse_args(["--max-restarts", "x", "y.py"])
    assert isinstance(run_parser(), argparse.ArgumentParser)


# A field's own check, declared with its flag: (argv, environment) -> the one-line error
_CHECKS: list[tuple[list[str], dict[str, str], str]] = [
    (["--metrics-port", "70000"], {}, "--metrics-port 70000: expected a port, 1..65535"),
    (["--master-port", "0"], {}, "--master-port 0: expected 1..65535"),
    (["--max-restarts", "-1"], {}, "--max-restarts -1: expected >= 0"),
    (["--rdzv-backend", "zk"], {}, "--rdzv-backend 'zk': expected one of static, c10d, etcd"),
    (["--restart-policy", "x"], {}, "--restart-policy 'x': expected one of any-failed, all-failed"),
    (["--rdzv-id", "../x"], {}, "--rdzv-id '../x': expected letters, digits"),
    (["--monitor-interval", "1e5"], {}, "--monitor-interval 100000.0: expected seconds > 0"),
    (["--shutdown-timeout", "-1"], {}, "--shutdown-timeout -1.0: expected seconds >= 0"),
    (["--survivor-grace", "-0.5"], {}, "--survivor-grace -0.5: expected seconds >= 0"),
    (["--survivor-grace", "nan"], {}, "--survivor-grace nan: expected seconds >= 0"),
    (["--survivor-grace", "1e9"], {}, "--survivor-grace 1000000000.0: expected seconds >= 0"),
    ([], {"STALWART_SURVIVOR_GRACE": "soon"}, "--survivor-grace 'soon': expected float"),
    # The environment skips argparse's choices; the declared check still holds.
    ([], {"STALWART_START_METHOD": "thread"}, "--start-method 'thread': expected spawn, fork"),
    ([], {"STALWART_MASTER_PORT": "x"}, "--master-port 'x': expected int"),
]


@pytest.mark.parametrize(("argv", "env", "message"), _CHECKS)
def test_declared_checks(
    argv: list[str], env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as info:
        build_config([*argv, "x.py"])
    assert str(info.value).startswith(message), str(info.value)
