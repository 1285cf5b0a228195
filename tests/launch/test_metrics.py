"""`--metrics-port`: a real 2-rank run scraped while it trains, restarts and trains on."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import cold_only, free_port, stalwart, start_stalwart, wait_for

from .helpers import SCRIPTS

pytestmark = [
    pytest.mark.timeout(120),
    cold_only,
]


def scrape(port: int) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def test_metrics_move_with_the_run(tmp_path: Path) -> None:
    port = free_port()
    proc = start_stalwart(
        "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", tmp_path / "logs",
        "--metrics-port", str(port), "--metrics-addr", "127.0.0.1",
        "--inject", "crash:rank=1,step=40", SCRIPTS / "timed_steps.py", tmp_path, "120", "0.05", "10",
    )  # fmt: skip
    try:
        first = wait_for(
            lambda: (m := scrape(port)) and m["stalwart_step"] >= 5 and m, 60, "steps in /metrics"
        )
        assert first["stalwart_attempt"] == 0 and first["stalwart_world_size"] == 2
        assert first["stalwart_restarts_total"] == 0
        assert first["stalwart_steps_per_second"] > 0
        assert 0 < first["stalwart_goodput_ratio"] < 1
        later = wait_for(
            lambda: (
                (m := scrape(port)) and m["stalwart_attempt"] == 1 and m["stalwart_step"] > 45 and m
            ),
            60,
            "the restarted attempt in /metrics",
        )
        assert later["stalwart_restarts_total"] == 1
        assert later["stalwart_worker_failures_total{kind=SIGSEGV}"] == 1
        assert later["stalwart_lost_seconds{cause=restart}"] > 0
        assert later["stalwart_lost_seconds{cause=recompute}"] > 0
        assert later["stalwart_productive_seconds"] > first["stalwart_productive_seconds"]
        assert later["stalwart_checkpoint_save_seconds_count"] == 0  # the toy saves no tensors
        assert later["stalwart_checkpoint_age_seconds"] >= 0
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # The endpoint goes away with the launcher.
    assert scrape(port) is None


def test_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = stalwart(
            "--metrics-port", str(port), "--metrics-addr", "127.0.0.1",
            "--log-dir", tmp_path / "logs", SCRIPTS / "steps.py", tmp_path,
        )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == (
        f"stalwart run: error: --metrics-port {port}: 127.0.0.1:{port} is already in use\n"
    )
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--metrics-port", "70000"], {}, "--metrics-port 70000: expected a port, 1..65535"),
        ([], {"STALWART_METRICS_PORT": "abc"}, "--metrics-port 'abc': expected int"),
    ],
)
def test_bad_port_is_named(
    args: list[str], env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stalwart.cli import build_config
    from stalwart.config import ConfigError

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as err:
        build_config([*args, "train.py"])
    assert str(err.value) == message


def test_port_from_yaml(tmp_path: Path) -> None:
    from stalwart.cli import build_config

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("metrics_port: 9464\nmetrics_addr: 127.0.0.1\n")
    cfg, _ = build_config(["--config", str(cfg_file), "train.py"])
    assert (cfg.metrics_port, cfg.metrics_addr) == (9464, "127.0.0.1")
