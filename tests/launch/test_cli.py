"""The command line: torchrun's flags, one-line errors for bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.cli import build_config
from stalwart.config import ConfigError
from stalwart.launch.logs import Std

from .helpers import SCRIPTS, stalwart

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--redirects", "7", "--redirects '7'"),
        ("--tee", "0:3,x", "--tee '0:3,x'"),
        ("--nnodes", "two", "--nnodes 'two'"),
        ("--nproc-per-node", "-1", "--nproc-per-node '-1'"),
        ("--inject", "explode:rank=1,step=3", "unknown fault 'explode'"),
        ("--inject", "crash:rank=1", "step=N is required"),
        ("--local-ranks-filter", "a,b", "--local-ranks-filter 'a,b'"),
        ("--max-restarts", "-2", "--max-restarts -2"),
        ("--rdzv-backend", "zookeeper", "--rdzv-backend 'zookeeper'"),
        ("--hb-timeout", "-1", "hb_timeout"),
        ("--section-timeout", "forward", "'forward'"),
        ("--safety-factor", "0.5", "safety_factor"),
        ("--hang-signal", "SIGNOPE", "SIGNOPE"),
    ],
)
def test_bad_value_is_one_line_error(flag: str, value: str, needle: str, tmp_path: Path) -> None:
    proc = stalwart(flag, value, "--log-dir", tmp_path, SCRIPTS / "envdump.py", tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0]
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir()), "nothing may be started or written on a bad flag"


def test_torchrun_spellings_and_per_rank_maps() -> None:
    cfg, _ = build_config(
        [
            "--nproc_per_node",
            "3",
            "--max_restarts=2",
            "-r",
            "0:3,2:1",
            "-t",
            "2",
            "--local_ranks_filter",
            "0,2",
            "--role",
            "trainer",
            "-m",
            "pkg.mod",
            "--",
            "--x",
            "1",
        ]
    )
    assert cfg.nproc_per_node == 3 and cfg.max_restarts == 2
    assert cfg.redirects == {0: Std.ALL, 2: Std.OUT}
    assert cfg.tee == Std.ERR
    assert cfg.local_ranks_filter == {0, 2}
    assert cfg.role == "trainer" and cfg.module and cfg.entrypoint == "pkg.mod"
    assert cfg.args == ["--x", "1"]


def test_precedence_defaults_yaml_env_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("max-restarts: 4\nshutdown_timeout: 7\nmonitor_interval: 0.5\n")
    monkeypatch.setenv("STALWART_SHUTDOWN_TIMEOUT", "9")
    cfg, _ = build_config(["--config", str(conf), "--monitor-interval", "0.2", "x.py"])
    assert cfg.max_restarts == 4  # YAML over default
    assert cfg.shutdown_timeout == 9.0  # env over YAML
    assert cfg.monitor_interval == 0.2  # flag over YAML
    with pytest.raises(ConfigError, match="--module and --no-python"):
        build_config(["-m", "--no-python", "x"])


def test_script_flags_are_never_taken_for_ours() -> None:
    cfg, _ = build_config(
        ["--nproc-per-node", "2", "train.py", "--out", "x", "--max-restarts", "9"]
    )
    assert cfg.entrypoint == "train.py"
    assert cfg.args == ["--out", "x", "--max-restarts", "9"]
    assert cfg.max_restarts == 0


def test_hang_detection_precedence_and_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("monitor:\n  hb_timeout: 7\n  section_timeouts: {fwd: 3}\n  safety_factor: 2\n")
    monkeypatch.setenv("STALWART_SAFETY_FACTOR", "4")
    cfg, _ = build_config(
        ["--config", str(conf), "--hb-timeout", "5", "--section-timeout", "bwd=9", "x.py"]
    )
    m = cfg.monitor
    assert m.hb_timeout == 5.0  # flag over YAML
    assert m.safety_factor == 4.0  # env over YAML
    assert m.section_timeouts == {"bwd": 9.0}  # a flag replaces the YAML mapping
    with pytest.raises(ConfigError, match="hb_initial_timeout"):
        build_config(["--hb-timeout", "5", "--hb-initial-timeout", "2", "x.py"])
