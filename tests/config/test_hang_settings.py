"""Hang detection's settings are parsed once, in `config.hang`: the monitor gets a typed,
checked `MonitorConfig`, and text that is no setting is one short line naming it."""

from __future__ import annotations

import math
import signal
from pathlib import Path
from typing import Any

import pytest

from stalwart.cli import build_config
from stalwart.config import ConfigError
from stalwart.config.hang import monitor_config
from stalwart.monitor import MonitorConfig


def test_flag_reaches_the_launch_config_as_a_typed_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STALWART_HB_TIMEOUT", raising=False)
    cfg, _ = build_config(["--hb-timeout", "5", "--section-timeout", "step=2", "x.py"])
    assert isinstance(cfg.monitor, MonitorConfig)
    assert cfg.monitor.hb_timeout == 5.0 and type(cfg.monitor.hb_timeout) is float
    assert cfg.monitor.section_timeouts == {"step": 2.0}
    auto, _ = build_config(["--hb-timeout", "auto", "x.py"])
    assert auto.monitor.hb_auto and auto.monitor.hb_timeout is None


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({"hb_timeout": "9" * 100_000}, "hb_timeout"),  # parses to inf: accepted, below
        ({"hb_timeout": "x" * 100_000}, "hb_timeout"),
        ({"hb_timeout": 10**400}, "hb_timeout"),  # YAML's big int: float() overflows
        ({"safety_factor": 10**400}, "safety_factor"),
        ({"auto_warmup_seconds": 10**400}, "auto_warmup_seconds"),
        ({"section_timeouts": ["a=" + "y" * 100_000]}, "section timeout 'a'"),
        ({"section_timeouts": "z" * 100_000}, "section timeout"),
        ({"k" * 100_000: 1}, "unknown monitor setting"),
        ({"evidence": ["a"] * 100_000}, "evidence"),
        ({"hb_timeout": True}, "hb_timeout"),
        ({"hb_timeout": "nan"}, "hb_timeout"),
        ({"hb_timeout": "-1"}, "hb_timeout"),
    ],
)
def test_hostile_values_are_one_short_line(data: dict[str, Any], names: str) -> None:
    """Oversized or non-numeric values (a YAML file is anyone's text): an error of one
    line that names the setting and stays short, never a traceback or the value whole."""
    try:
        cfg = monitor_config(data)
    except ConfigError as err:
        text = str(err)
        assert text.startswith("hang detection: ") and names in text
        assert "\n" not in text and len(text) < 300, text[:400]
    else:
        assert math.isinf(cfg.hb_timeout or 0.0)  # only the all-nines string parses


def test_cli_names_the_bad_flag_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STALWART_HB_TIMEOUT", raising=False)
    with pytest.raises(ConfigError, match=r"^hang detection: hb_timeout must be a number of se"):
        build_config(["--hb-timeout", "soon", "x.py"])
    monkeypatch.setenv("STALWART_HB_TIMEOUT", "0")
    with pytest.raises(ConfigError, match=r"hb_timeout must be > 0 seconds, got 0.0$"):
        build_config(["x.py"])


def test_yaml_monitor_mapping_is_parsed_once(tmp_path: Path) -> None:
    conf = tmp_path / "job.yaml"
    conf.write_text("monitor:\n  hb_timeout: '3'\n  term_signal: KILL\n  evidence: 'no'\n")
    cfg, _ = build_config(["--config", str(conf), "x.py"])
    assert cfg.monitor.hb_timeout == 3.0 and cfg.monitor.term_signal is signal.SIGKILL
    assert cfg.monitor.evidence is False
