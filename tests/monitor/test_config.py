"""MonitorConfig validation and parsing: every rejection is one line naming the value."""

from __future__ import annotations

import signal

import pytest

from stalwart.config.hang import monitor_config, parse_section_timeout
from stalwart.monitor import MonitorConfig


def test_defaults_disable_everything() -> None:
    cfg = MonitorConfig()
    assert not cfg.enabled and cfg.effective_initial_timeout is None


def test_initial_timeout_defaults_to_at_least_a_minute() -> None:
    assert MonitorConfig(hb_timeout=2).effective_initial_timeout == 60.0
    assert MonitorConfig(hb_timeout=90).effective_initial_timeout == 90.0
    assert MonitorConfig(hb_timeout=2, hb_initial_timeout=5).effective_initial_timeout == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hb_timeout": -1}, "hb_timeout must be > 0 seconds, got -1"),
        ({"hb_timeout": 0}, "hb_timeout must be > 0"),
        ({"hb_timeout": "2"}, "hb_timeout must be a number"),
        ({"hb_timeout": 10, "hb_initial_timeout": 5}, "hb_initial_timeout (5) must not be shorter"),
        ({"section_timeouts": {"fwd": -2}}, "section timeout 'fwd' must be > 0"),
        ({"section_timeouts": {"": 2}}, "non-empty"),
        ({"safety_factor": 0.5}, "safety_factor must be >= 1"),
        ({"check_interval": 0}, "check_interval must be > 0"),
        ({"stack_dump_wait": -0.1}, "stack_dump_wait must be >= 0"),
        ({"term_signal": "SIGNOPE"}, "unknown signal 'SIGNOPE'"),
    ],
)
def test_bad_values_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        MonitorConfig(**kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"safety_factor": 0}, "safety_factor must be > 0, got 0"),
        ({"safety_factor": float("nan")}, "safety_factor must be > 0, got nan"),
        ({"straggler_factor": -2}, "straggler_factor must be > 0, got -2"),
        ({"auto_percentile": 0}, "auto_percentile must be > 0, got 0"),
        ({"safety_factor": "0"}, "safety_factor must be > 0, got 0.0"),
        ({"safety_factor": "big"}, "safety_factor must be a number, got 'big'"),
        ({"straggler_factor": "x"}, "straggler_factor must be a number, got 'x'"),
        ({"auto_percentile": "p99"}, "auto_percentile must be a number, got 'p99'"),
    ],
)
def test_factors_are_not_seconds(data: dict[str, object], message: str) -> None:
    """A factor or percentile has no unit: its error must not speak of seconds (numbers
    go to the constructor, strings through config.hang as YAML/env/flags do)."""
    text = isinstance(next(iter(data.values())), str)
    with pytest.raises(ValueError) as info:
        if text:
            monitor_config(data)
        else:
            MonitorConfig(**data)  # type: ignore[arg-type]
    assert str(info.value) == (f"hang detection: {message}" if text else message)


def test_inf_hb_timeout_is_accepted_and_never_fires() -> None:
    cfg = monitor_config({"hb_timeout": "inf"})
    assert cfg.hb_timeout == float("inf") and cfg.enabled


def test_parse_section_timeout() -> None:
    assert parse_section_timeout("fwd=2.5") == ("fwd", 2.5)
    assert parse_section_timeout(" data = 10 ") == ("data", 10.0)
    for bad in ("fwd", "=3", "fwd=", "fwd=abc", "fwd=-1"):
        with pytest.raises(ValueError) as info:
            parse_section_timeout(bad)
        assert "section timeout" in str(info.value) and "\n" not in str(info.value)


def test_from_mapping_accepts_yaml_and_env_shapes() -> None:
    cfg = monitor_config(
        {
            "hb_timeout": "2",
            "hb_initial_timeout": 30,
            "section_timeouts": "fwd=1, bwd=2",
            "out_of_section_timeout": "4.5",
            "safety_factor": "3",
            "check_interval": None,
            "term_signal": "KILL",
            "stack_dump_wait": "0",
        }
    )
    assert cfg.hb_timeout == 2.0 and cfg.hb_initial_timeout == 30.0
    assert cfg.section_timeouts == {"fwd": 1.0, "bwd": 2.0}
    assert cfg.out_of_section_timeout == 4.5 and cfg.safety_factor == 3.0
    assert cfg.check_interval == 0.1 and cfg.term_signal is signal.SIGKILL
    assert cfg.stack_dump_wait == 0.0
    assert monitor_config({"section_timeouts": ["a=1"]}).section_timeouts == {"a": 1.0}
    assert monitor_config({"section_timeouts": {"a": "1"}}).section_timeouts == {"a": 1.0}
    assert monitor_config({"term_signal": 15}).term_signal is signal.SIGTERM
    assert cfg.to_dict()["term_signal"] == "SIGKILL"


def test_from_mapping_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown monitor setting.*hb_timout"):
        monitor_config({"hb_timout": 2})
    with pytest.raises(ValueError, match="hb_timeout must be a number of seconds, got 'soon'"):
        monitor_config({"hb_timeout": "soon"})
    with pytest.raises(ValueError, match="name=seconds"):
        monitor_config({"section_timeouts": "fwd"})
