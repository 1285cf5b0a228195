"""NVIDIA's `FaultToleranceConfig` API (issue 26): kwargs, YAML both ways, `--ft-*`
options; bad and hostile input refused in one line, nothing constructed or left over.
Pure tests: no processes."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from stalwart.base.yamlfile import MAX_YAML_BYTES
from stalwart.compat.ft_launcher import get_args_parser
from stalwart.monitor import FaultToleranceConfig
from stalwart.monitor.ft_config import (
    Kind,
    check,
    find_section,
    not_acted_on,
    parse_section_timeouts,
)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def _one_line(err: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(err.value)
    assert "\n" not in text and len(text) < 600, text
    return text


def test_yaml_round_trip_keeps_every_field_and_leaves_nothing_else(tmp_path: Path) -> None:
    cfg = FaultToleranceConfig(
        workload_check_interval=0.5,
        initial_rank_heartbeat_timeout=None,
        rank_heartbeat_timeout=float("inf"),
        rank_section_timeouts={"step": 30.0, "save": None},
        rank_out_of_section_timeout=12,
        safety_factor=0.567,
        rank_termination_signal="usr2",
        log_level="warn",
        enable_nic_monitor=False,
        pci_topo_file="/etc/topo.xml",
    )
    assert cfg.rank_termination_signal is signal.SIGUSR2
    assert cfg.log_level == logging.WARNING
    assert cfg.rank_out_of_section_timeout == 12.0
    path = tmp_path / "ft.yaml"
    cfg.to_yaml_file(path)
    text = path.read_text()
    assert text.startswith("fault_tolerance:\n") and "!!" not in text
    assert "rank_termination_signal: SIGUSR2" in text
    assert FaultToleranceConfig.from_yaml_file(path) == cfg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ft.yaml"]
    # Assigned after construction: checked again before anything is written.
    cfg.log_level = "loud"
    with pytest.raises(ValueError, match=r"log_level must be a log level name .* got 'loud'"):
        cfg.to_yaml_file(path)
    assert FaultToleranceConfig.from_yaml_file(path).log_level == logging.WARNING
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ft.yaml"]


def test_nested_section_and_unknown_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _write(
        tmp_path,
        "model: {layers: 4}\nrun:\n  - fault_tolerance: {}\n"
        "  - fault_tolerance:\n      rank_heartbeat_timeout: 7\n      rank_hb_timeout: 9\n",
    )
    with caplog.at_level(logging.WARNING):
        assert FaultToleranceConfig.from_yaml_file(path).rank_heartbeat_timeout == 7.0
    assert "rank_hb_timeout" in caplog.text
    with pytest.raises(ValueError) as err:
        FaultToleranceConfig.from_yaml_file(path, ignore_not_recognized=False)
    assert f"{path}: fault_tolerance: " in _one_line(err) and "rank_hb_timeout" in str(err.value)


def test_from_kwargs_unknown_key_is_one_clear_error(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError) as err:
        FaultToleranceConfig.from_kwargs(ignore_not_recognized=False, rank_hb_timeout=3)
    assert "not recognized: rank_hb_timeout (expected some of workload_check_interval" in (
        _one_line(err)
    )
    with caplog.at_level(logging.WARNING):
        cfg = FaultToleranceConfig.from_kwargs(rank_hb_timeout=3, safety_factor=2)
    assert cfg.safety_factor == 2.0 and "rank_hb_timeout" in caplog.text
    many = {f"k{i}": i for i in range(1000)}
    with pytest.raises(ValueError) as err:
        FaultToleranceConfig.from_kwargs(ignore_not_recognized=False, **many)
    assert "and 995 more" in _one_line(err)


@pytest.mark.parametrize(
    ("name", "kind", "value", "expected"),
    [
        ("t", Kind.TIMEOUT, None, None),
        ("t", Kind.TIMEOUT, 3, 3.0),
        ("t", Kind.TIMEOUT, float("inf"), float("inf")),
        ("t", Kind.TIMEOUT, 0, "t must be None or a number of seconds > 0, got 0"),
        ("t", Kind.TIMEOUT, "10", "got '10'"),
        ("t", Kind.TIMEOUT, True, "got True"),
        ("t", Kind.TIMEOUT, float("nan"), "got nan"),
        ("i", Kind.SECONDS, float("inf"), "i must be a finite number of seconds > 0, got inf"),
        ("i", Kind.SECONDS, None, "got None"),
        ("f", Kind.FACTOR, 0.5, 0.5),
        ("f", Kind.FACTOR, -1, "f must be a finite number > 0, got -1"),
        ("s", Kind.SIGNAL, 9, signal.SIGKILL),
        ("s", Kind.SIGNAL, "SIGUSR2", signal.SIGUSR2),
        ("s", Kind.SIGNAL, "term", signal.SIGTERM),
        ("s", Kind.SIGNAL, None, "s must be a signal name (SIGKILL) or number, got None"),
        ("s", Kind.SIGNAL, -999, "got -999"),
        ("s", Kind.SIGNAL, True, "got True"),
        ("s", Kind.SIGNAL, "not a signal", "got 'not a signal'"),
        ("l", Kind.LOG_LEVEL, "deBUG", logging.DEBUG),
        ("l", Kind.LOG_LEVEL, "critical", logging.CRITICAL),
        ("l", Kind.LOG_LEVEL, 15, 15),
        ("l", Kind.LOG_LEVEL, 0, "l must be a log level name"),
        ("l", Kind.LOG_LEVEL, None, "got None"),
        ("b", Kind.FLAG, "yes", "b must be true or false, got 'yes'"),
        ("p", Kind.TEXT, 3, "p must be None or a string, got 3"),
        ("x", Kind.SECTIONS, {"a": 1}, {"a": 1.0}),
        ("x", Kind.SECTIONS, {"a": None}, {"a": None}),
        ("x", Kind.SECTIONS, ["a"], "x must map section names to None or seconds > 0"),
        ("x", Kind.SECTIONS, {1: 5}, "x: section names must be non-empty strings, got 1"),
        ("x", Kind.SECTIONS, {"a": -1}, "x['a'] must be None or a number of seconds > 0"),
        ("x", Kind.SECTIONS, {"a" * 49: 1}, "longer than 48 UTF-8 bytes"),
        ("x", Kind.SECTIONS, {f"s{i}": 1 for i in range(33)}, "a rank tracks at most 32"),
        ("t", Kind.TIMEOUT, "x" * 10_000, "got 'xxxxx"),
    ],
)
def test_check(name: str, kind: Kind, value: Any, expected: Any) -> None:
    if isinstance(expected, str):
        with pytest.raises(ValueError) as err:
            check(name, kind, value)
        assert expected in _one_line(err)
    else:
        assert check(name, kind, value) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("custom1:111.1,custom2:222.2", {"custom1": 111.1, "custom2": 222.2}),
        (" a : none , b:null,c:", {"a": None, "b": None, "c": None}),
        ("", {}),
        ("a", "expected name:seconds"),
        ("a:1:2", "expected name:seconds"),
        (":5", "expected name:seconds"),
        ("a:soon", "'a' must be seconds or none, got 'soon'"),
    ],
)
def test_parse_section_timeouts(text: str, expected: Any) -> None:
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            parse_section_timeouts(text)
    else:
        assert parse_section_timeouts(text) == expected


def _python_tag(marker: Path) -> str:
    return f'fault_tolerance: !!python/object/apply:os.system ["touch {marker}"]\n'


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("PYTHON_TAG", "cannot read YAML (could not determine a constructor"),
        ("fault_tolerance: !!python/object:argparse.Namespace {}\n", "cannot read YAML"),
        ("- 1\n- 2\n", "no non-empty 'fault_tolerance:' section"),
        ("just text\n", "no non-empty 'fault_tolerance:' section"),
        ("", "no non-empty 'fault_tolerance:' section"),
        ("fault_tolerance: [1, 2]\n", "'fault_tolerance:' must be a mapping of settings, got list"),
        (
            "fault_tolerance: {rank_heartbeat_timeout: '10'}\n",
            "fault_tolerance: rank_heartbeat_timeout must be None or a number of seconds",
        ),
        ("fault_tolerance: {rank_termination_signal: SIGNOPE}\n", "got 'SIGNOPE'"),
        ("fault_tolerance: {a: [}\n", "cannot read YAML"),
        ("[" * 1000 + "]" * 1000, "YAML nested too deeply"),
        # Aliases: a billion-laughs document, and a list that holds itself.
        (
            "a: &a [x,x,x,x,x,x,x,x,x,x]\n"
            + "".join(
                f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 10)}]\n"
                for i in range(9)
            ),
            "YAML aliases expand to more than",
        ),
        # The same bomb as a setting's value: checking it printed all of it.
        (
            "x: [&a [x,x,x,x,x,x,x,x,x,x], "
            + ", ".join(f"&{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 10)}]" for i in range(8))
            + "]\nfault_tolerance: {rank_heartbeat_timeout: *i}\n",
            "YAML aliases expand to more than",
        ),
        ("&a [*a, {b: *a}]\n", "a YAML alias refers to a value that holds it"),
        ("OVERSIZED", f"larger than {MAX_YAML_BYTES} bytes"),
    ],
)
def test_hostile_yaml_is_refused_in_one_line(tmp_path: Path, content: str, message: str) -> None:
    marker = tmp_path / "constructed"
    if content == "PYTHON_TAG":
        content = _python_tag(marker)
    elif content == "OVERSIZED":
        content = "fault_tolerance: {safety_factor: 2}\n#" + "x" * MAX_YAML_BYTES
    path = _write(tmp_path, content)
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        FaultToleranceConfig.from_yaml_file(path)
    assert message in _one_line(err)
    assert time.monotonic() - start < 5.0
    assert not marker.exists()


def test_a_fifo_at_the_path_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    os.mkfifo(path)
    with pytest.raises(ValueError, match="not a regular file"):
        FaultToleranceConfig.from_yaml_file(path)


def test_find_section_order() -> None:
    doc = {"x": [{"fault_tolerance": None}, {"y": {"fault_tolerance": {"a": 1}}}]}
    assert find_section(doc) == {"a": 1}
    assert find_section({"fault_tolerance": {"b": 2}, "z": {"fault_tolerance": {"a": 1}}}) == {
        "b": 2
    }


def test_from_args_file_then_options(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "fault_tolerance:\n  rank_heartbeat_timeout: 50\n  safety_factor: 3\n"
        "  enable_nic_monitor: false\n",
    )
    parser = get_args_parser()
    args = parser.parse_args(
        [
            "--nproc-per-node",
            "2",
            "--ft-cfg-path",
            str(path),
            "--ft-rank_heartbeat_timeout",
            "40",
            "--ft-rank-section-timeouts",
            "step:5,save:none",
            "train.py",
            "--ft-safety-factor",
            "9",
        ]
    )
    cfg = FaultToleranceConfig.from_args(args)
    assert cfg.rank_heartbeat_timeout == 40.0 and cfg.safety_factor == 3.0
    assert cfg.rank_section_timeouts == {"step": 5.0, "save": None}
    assert cfg.enable_nic_monitor is False
    assert args.args == ["--ft-safety-factor", "9"]  # the script's own, not ours
    # A training config without the section: the defaults and the options (as NVIDIA's).
    other = _write(tmp_path, "model: {layers: 4}\n")
    args = parser.parse_args(["--ft-cfg-path", str(other), "--ft-log-level", "error", "t.py"])
    assert FaultToleranceConfig.from_args(args).log_level == logging.ERROR
    assert FaultToleranceConfig.from_args(parser.parse_args(["t.py"])) == FaultToleranceConfig()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ft-cfg-path", "MISSING", "t.py"], "--ft-cfg-path .*MISSING: no such file"),
        (["--ft-cfg-path", "BAD", "t.py"], "rank_heartbeat_timeout must be None or a number"),
        (["--ft-rank-section-timeouts", "a=5", "t.py"], "expected name:seconds"),
        (["--ft-rank-termination-signal", "SIGNOPE", "t.py"], "got 'SIGNOPE'"),
    ],
)
def test_from_args_bad_input(tmp_path: Path, argv: list[str], message: str) -> None:
    _write(tmp_path, "fault_tolerance: {rank_heartbeat_timeout: -1}\n").rename(tmp_path / "BAD")
    argv = [str(tmp_path / a) if a in ("MISSING", "BAD") else a for a in argv]
    args = get_args_parser().parse_args(argv)
    with pytest.raises(ValueError, match=message) as err:
        FaultToleranceConfig.from_args(args)
    _one_line(err)


def test_from_args_needs_the_ft_options() -> None:
    import argparse

    with pytest.raises(ValueError, match="has no ft_\\* attributes"):
        FaultToleranceConfig.from_args(argparse.Namespace(nnodes="1"))


def test_to_yaml_file_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("keep")
    path = tmp_path / "ft.yaml"
    os.symlink(target, tmp_path / f".ft.yaml.{os.getpid()}.tmp")
    with pytest.raises(FileExistsError):
        FaultToleranceConfig().to_yaml_file(path)
    assert target.read_text() == "keep" and not path.exists()


def test_fields_not_acted_on_are_named() -> None:
    assert not_acted_on() == [
        "node_health_check_interval",
        "log_level",
        "restart_check_interval",
        "enable_nic_monitor",
        "pci_topo_file",
        "link_down_path_template",
    ]


def test_nvidia_config_module_path_names_the_same_class() -> None:
    # `from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig`
    # with the package prefix changed.
    from stalwart.monitor.config import FaultToleranceConfig as via_config

    assert via_config is FaultToleranceConfig
