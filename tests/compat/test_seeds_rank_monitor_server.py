"""NVIDIA's own per-rank monitor under stalwart (issue 26 item 2): code that starts
``RankMonitorServer.run_in_subprocess`` itself and points its rank at it through
``FT_RANK_MONITOR_IPC_SOCKET`` runs with only its import lines changed. One program,
written as NVIDIA's unit tests write it but without a ``__main__`` guard, runs three
ranks in turn against one monitor: one sends its heartbeats and exits (not signalled),
one stops sending them (signalled with the configured signal), one is killed and a
fresh one attaches after it; the monitor's files go when it is terminated. The rest
are the settings and the files a stranger could plant, as tables."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from stalwart.monitor import FaultToleranceConfig, RankMonitorClient, RankMonitorClientError
from stalwart.monitor.data import FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR
from stalwart.monitor.nvidia_server import MAX_TIMEOUTS_BYTES, RankMonitorServer, timeouts_path
from stalwart.monitor.utils import wait_for_mp_events
from tests.helpers import ROOT, clean_env

# No __main__ guard: a monitor started through multiprocessing's spawn would run it all
# again in the monitor's process.
PROGRAM = """
import os, signal, subprocess, sys, time
from stalwart import monitor as fault_tolerance
from stalwart.monitor.data import FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR

path = sys.argv[1]
cfg = fault_tolerance.FaultToleranceConfig()
cfg.initial_rank_heartbeat_timeout = 3.0
cfg.rank_heartbeat_timeout = 1.5
cfg.workload_check_interval = 0.2
cfg.rank_termination_signal = signal.SIGUSR1
server = fault_tolerance.RankMonitorServer.run_in_subprocess(cfg=cfg, ipc_socket_path=path)
print("STARTED", flush=True)

RANK = '''
import signal, sys, time
from stalwart import monitor as fault_tolerance
signal.signal(signal.SIGUSR1, lambda *a: sys.exit(123))
client = fault_tolerance.RankMonitorClient()
assert client.hb_timeouts is None
client.init_workload_monitoring()
print("TIMEOUTS", client.hb_timeouts.initial, client.hb_timeouts.subsequent, flush=True)
for _ in range(5):
    client.send_heartbeat()
    time.sleep(0.2)
mode = sys.argv[1]
if mode == "hang":
    time.sleep(60)
elif mode == "killed":
    time.sleep(60)
'''
env = dict(os.environ, FT_RANK_MONITOR_IPC_SOCKET=path)
codes = []
for mode in ("done", "hang", "killed", "done"):
    out = subprocess.PIPE if mode == "killed" else None
    rank = subprocess.Popen([sys.executable, "-c", RANK, mode], env=env, stdout=out, text=True)
    if mode == "killed":
        print(rank.stdout.readline(), end="", flush=True)  # attached: now kill it
        rank.kill()
    codes.append(rank.wait(timeout=60))
print("CODES", codes, flush=True)
server.terminate()
server.join(timeout=30)
print("GONE", os.path.exists(path), os.path.exists(path + ".timeouts.json"), server.is_alive(),
      flush=True)
"""


@pytest.mark.timeout(120)
def test_code_written_for_nvidias_monitor_runs_with_its_import_changed(tmp_path: Path) -> None:
    script = tmp_path / "nvidia_style.py"
    script.write_text(PROGRAM)
    path = tmp_path / "rmon.socket"
    proc = subprocess.run(
        [sys.executable, str(script), str(path)],
        capture_output=True, text=True, timeout=110, env=clean_env(), cwd=ROOT,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.count("STARTED") == 1, out  # the script ran once, not again in the monitor
    assert out.count("TIMEOUTS 3.0 1.5") == 4, out
    # done: 0; stopped beating: the configured signal (its handler exits 123);
    # killed: -9, then a fresh rank attaches and is not signalled for its predecessor.
    assert "CODES [0, 123, -9, 0]" in out, (out, proc.stderr[-2000:])
    assert "GONE False False False" in out, out
    assert "missed its" in proc.stderr and proc.stderr.count("sending SIGUSR1") == 1


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rank_heartbeat_timeout", -1, r"rank_heartbeat_timeout must be None or a number .* -1"),
        ("rank_heartbeat_timeout", "10", r"rank_heartbeat_timeout .* got '10'"),
        ("rank_out_of_section_timeout", True, r"rank_out_of_section_timeout .* got True"),
        ("rank_section_timeouts", {"a": 0}, r"rank_section_timeouts\['a'\] .* got 0"),
        ("rank_section_timeouts", {"": 5}, "section names must be non-empty strings, got ''"),
        ("rank_section_timeouts", ["a"], r"rank_section_timeouts must map section names"),
        ("rank_termination_signal", "SIGNOPE", "SIGNOPE"),
        ("workload_check_interval", 0, r"workload_check_interval .* got 0"),
    ],
)
def test_bad_settings_are_named_and_nothing_is_created(
    tmp_path: Path, field: str, value: Any, message: str
) -> None:
    cfg = FaultToleranceConfig()
    setattr(cfg, field, value)
    path = tmp_path / "rmon.socket"
    with pytest.raises(ValueError, match=message):
        RankMonitorServer.run_in_subprocess(cfg=cfg, ipc_socket_path=str(path))
    assert list(tmp_path.iterdir()) == []


def _client_at(monkeypatch: pytest.MonkeyPatch, path: Path) -> RankMonitorClient:
    monkeypatch.setenv(FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR, str(path))
    for name in list(os.environ):
        if name.startswith("STALWART_"):
            monkeypatch.delenv(name)
    return RankMonitorClient()


@pytest.mark.skipif(os.getuid() != 0, reason="planting another user's file needs root")
def test_a_strangers_file_at_the_path_is_neither_used_nor_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp_path.chmod(0o777)
    path = tmp_path / "rmon.socket"
    path.write_bytes(b"planted")
    os.chown(path, 65534, 65534)
    with pytest.raises(PermissionError, match=r"belongs to uid 65534; not removing it"):
        RankMonitorServer.run_in_subprocess(cfg=FaultToleranceConfig(), ipc_socket_path=str(path))
    assert path.read_bytes() == b"planted"
    with pytest.raises(RankMonitorClientError, match=r"not a regular file of this user"):
        _client_at(monkeypatch, path).init_workload_monitoring()


def test_a_symlink_or_a_foreign_file_is_no_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(bytes(8192))
    link = tmp_path / "rmon.socket"
    link.symlink_to(target)
    with pytest.raises(RankMonitorClientError, match=r"rmon.socket.*not a regular file"):
        _client_at(monkeypatch, link).init_workload_monitoring()
    with pytest.raises(RankMonitorClientError, match=r"not a stalwart monitor segment"):
        _client_at(monkeypatch, target).init_workload_monitoring()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        # hostile values are dropped one by one
        (json.dumps({"hb": "x", "hb_initial": -5, "oos": 1e999, "sections": {"a": None}}), None),
        ("not json", None),
        (json.dumps([1, 2]), None),
    ],
)
def test_hostile_configured_timeouts_are_not_believed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str, expected: Any
) -> None:
    path = tmp_path / "rmon.socket"
    server = RankMonitorServer.run_in_subprocess(
        cfg=FaultToleranceConfig(), ipc_socket_path=str(path)
    )
    try:
        side = timeouts_path(path)
        side.write_text(content)
        client = _client_at(monkeypatch, path)
        client.init_workload_monitoring()
        hb = client.hb_timeouts
        assert hb is not None and (hb.initial, hb.subsequent) == (expected, expected)
        client.shutdown_workload_monitoring()
        side.write_bytes(b" " * (MAX_TIMEOUTS_BYTES + 1))
        with pytest.raises(RankMonitorClientError, match=f"larger than {MAX_TIMEOUTS_BYTES}"):
            _client_at(monkeypatch, path).init_workload_monitoring()
    finally:
        server.terminate()
        server.join(timeout=30)
    assert not path.exists() and not timeouts_path(path).exists()


@pytest.mark.parametrize(("flags", "timeout", "raises"), [
    ([True, True], 0.0, None),
    ([True, False, False], 0.05, "2 of 3 events were not set within 0.05 s"),
    ([], 0.0, None),
])  # fmt: skip
def test_waiting_for_events(flags: list[bool], timeout: float, raises: str | None) -> None:
    events = [threading.Event() for _ in flags]
    for event, flag in zip(events, flags, strict=True):
        if flag:
            event.set()
    if raises is None:
        wait_for_mp_events(events, timeout)
    else:
        with pytest.raises(TimeoutError, match=raises):
            wait_for_mp_events(events, timeout)


@pytest.mark.parametrize("bad", [-1, "5", math.nan, True])
def test_a_bad_wait_is_named(bad: Any) -> None:
    with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0, got "):
        wait_for_mp_events([], bad)


def test_a_new_estimate_is_averaged_into_the_learned_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """As NVIDIA's client: recalculating merges (EMA, alpha 0.5) instead of replacing, so
    a few quick heartbeats just before exit do not shrink the timeout to their gaps; and
    every section the config names must have been seen before timeouts are set."""
    import stalwart.monitor.client as client_module

    now = [100.0]
    monkeypatch.setattr(client_module, "_monotonic", lambda: now[0])
    for name in list(os.environ):
        if name.startswith("STALWART_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("STALWART_MONITOR_TIMEOUTS", json.dumps({"sections": {"ckpt": 60}}))
    client = RankMonitorClient(safety_factor=2.0)
    client.init_workload_monitoring()
    for at in (101.0, 105.0):  # first beat after 1 s, then a 4 s gap
        now[0] = at
        client.send_heartbeat()
    assert client.calculate_and_set_hb_timeouts()
    assert (client.learned.hb_initial, client.learned.hb) == (8.0, 8.0)
    now[0] = 105.5
    client.send_heartbeat()  # the longest gap stays 4 s: same estimate
    client._max_hb_gap = 1.0  # as after a restart with quick beats: estimate 2 s
    assert client.calculate_and_set_hb_timeouts()
    assert client.learned.hb == 5.0  # (8 + 2) / 2
    client.start_section("step")
    now[0] = 106.5
    client.end_section("step")
    with pytest.raises(RankMonitorClientError, match="'ckpt'"):
        client.calculate_and_set_section_timeouts()
    assert client.calculate_and_set_section_timeouts(selected_sections=["step"])
    assert client.learned.sections == {"step": 2.0}


@pytest.mark.parametrize(
    ("server_factor", "side_factor", "client_factor", "expected"),
    [
        (2.0, None, None, 2.0),  # the server's config, as NVIDIA's client takes it
        (5.0, None, None, 5.0),
        (2.0, None, 3.0, 3.0),  # a factor the rank's code gives itself wins
        # A side file that does not hold a usable factor: the rank's own (5).
        (2.0, "x", None, 5.0),
        (2.0, -1, None, 5.0),
        (2.0, True, None, 5.0),
        (2.0, "1e999", None, 5.0),
    ],
)
def test_learned_timeouts_use_the_servers_safety_factor(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    server_factor: float,
    side_factor: Any,
    client_factor: float | None,
    expected: float,
) -> None:
    import stalwart.monitor.client as client_module

    now = [100.0]
    monkeypatch.setattr(client_module, "_monotonic", lambda: now[0])
    cfg = FaultToleranceConfig()
    cfg.safety_factor = server_factor
    cfg.rank_section_timeouts = {"step": 100.0}
    path = tmp_path / "rmon.socket"
    server = RankMonitorServer.run_in_subprocess(cfg=cfg, ipc_socket_path=str(path))
    try:
        side = timeouts_path(path)
        if side_factor is not None:
            data = json.loads(side.read_text())
            data["safety_factor"] = side_factor
            text = json.dumps(data).replace('"1e999"', "1e999")
            side.write_text(text)
        client = _client_at(monkeypatch, path)
        if client_factor is not None:
            client = RankMonitorClient(safety_factor=client_factor)
        client.init_workload_monitoring()
        for at in (101.0, 105.0):  # first beat after 1 s, then a 4 s gap
            now[0] = at
            client.send_heartbeat()
        client.start_section("step")
        now[0] = 108.0  # a 3 s section
        client.end_section("step")
        assert client.calculate_and_set_hb_timeouts()
        assert client.calculate_and_set_section_timeouts(calc_out_of_section=False)
        assert client.hb_timeouts is not None and client.section_timeouts is not None
        assert (client.hb_timeouts.initial, client.hb_timeouts.subsequent) == (
            4.0 * expected,
            4.0 * expected,
        )
        assert client.section_timeouts.section["step"] == 3.0 * expected
        client.shutdown_workload_monitoring()
    finally:
        server.terminate()
        server.join(timeout=30)
