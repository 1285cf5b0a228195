"""``--metrics-port`` as a stranger on the host sees it: a connection flood and slowloris
peers against a launcher held to 256 descriptors, and a malformed line in the events
file; the launcher, its job and the endpoint all carry on."""

from __future__ import annotations

import json
import logging
import resource
import socket
import subprocess
import time
from pathlib import Path

import pytest

from stalwart.reporting.metrics import MetricsServer
from tests.helpers import ROOT, STARTED, clean_env, cold_only, free_port, stalwart_argv, wait_for
from tests.launch.test_metrics import scrape

pytestmark = [pytest.mark.timeout(180), cold_only]

FD_LIMIT = 256
# A connection's time in all (docs/launcher.md, "Prometheus metrics").
REQUEST_DEADLINE = 10.0
GATED = Path(__file__).with_name("records_gated_steps.py")


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def _connect(port: int) -> socket.socket | None:
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    return s


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the server has ended this connection (EOF or reset)."""
    try:
        s.settimeout(0.01)
        return s.recv(4096) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_flood_and_slowloris_leave_the_launcher_and_job_running(tmp_path: Path) -> None:
    port = free_port()
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        stalwart_argv(
            "--nproc-per-node", "2", "--log-dir", logs, "--rdzv-id", "flood",
            "--metrics-port", port, "--metrics-addr", "127.0.0.1",
            GATED, tmp_path,
        ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=ROOT,
        preexec_fn=_limit_fds,
    )  # fmt: skip
    STARTED.append(proc)
    held: list[socket.socket] = []
    try:
        wait_for(lambda: (m := scrape(port)) and m["stalwart_step"] >= 2, 60, "steps in /metrics")
        # Slowloris: a request begun and never finished, one header byte now and then.
        for _ in range(3 * FD_LIMIT):
            s = _connect(port)
            if s is not None:
                try:
                    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                except OSError:
                    s.close()
                    continue
                held.append(s)
        # A worker appends a line the metrics cannot read (as one could, by mistake).
        events_file = logs / "flood" / "events.jsonl"
        with open(events_file, "a") as fh:
            fh.write(json.dumps({"event": "progress", "time": "abc", "step": 1}) + "\n")
        # Every slow peer is cut off: past the per-connection deadline, or at once when
        # over the cap. Trickling bytes does not keep a connection open.
        deadline = time.monotonic() + REQUEST_DEADLINE + 10
        while time.monotonic() < deadline:
            for s in held:
                try:
                    s.send(b"a")
                except OSError:
                    pass
            if all(_closed_by_peer(s) for s in held):
                break
            time.sleep(1)
        open_ = [s for s in held if not _closed_by_peer(s)]
        assert not open_, f"{len(open_)} slow connections still open"
        assert proc.poll() is None, proc.communicate()
        later = wait_for(lambda: scrape(port), 30, "a scrape after the flood")
        assert later["stalwart_world_size"] == 2
        wait_for(
            lambda: (m := scrape(port)) and m["stalwart_step"] > later["stalwart_step"],
            30,
            "steps going on after the flood",
        )
        (tmp_path / "go").write_text("")
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert "Traceback" not in err and "Too many open files" not in err
        # Bad input is told in a few rate-limited lines, not one per connection.
        assert err.count("metrics:") <= 5, err
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_malformed_event_leaves_the_metrics_correct(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    events = tmp_path / "events.jsonl"
    good = [
        {"event": "launcher_start", "time": 100.0},
        {"event": "rendezvous_done", "time": 101.0, "attempt": 0, "world_size": 2},
        {"event": "progress", "time": 102.0, "attempt": 0, "local_rank": 0, "step": 3},
    ]
    bad = [
        {"event": "progress", "time": "abc", "attempt": 0, "step": 4},
        {"event": "restart", "time": 103.0, "attempt": "0"},
        {"event": "checkpoint_commit", "time": 1e400},
    ]
    lines = [json.dumps(r) for r in good[:2]] + [json.dumps(r) for r in bad] + [json.dumps(good[2])]
    events.write_text("\n".join(lines) + "\nnot json\n")
    server = MetricsServer(0, "127.0.0.1")
    server.watch(events)
    try:
        with caplog.at_level(logging.WARNING):
            first = scrape(server.port)
            assert first is not None, "the scrape failed"
            with open(events, "a") as fh:
                fh.write(json.dumps({"event": "progress", "time": 104.0, "attempt": 0,
                                     "local_rank": 0, "step": 9}) + "\n")  # fmt: skip
            second = scrape(server.port)
    finally:
        server.close()
    assert first["stalwart_world_size"] == 2 and first["stalwart_step"] == 3
    assert first["stalwart_restarts_total"] == 0
    assert second is not None and second["stalwart_step"] == 9
    # Five bad lines, one warning line (rate-limited).
    assert len([r for r in caplog.records if "malformed line" in r.getMessage()]) == 1


def test_a_request_too_large_or_malformed_is_refused_without_a_traceback(
    capfd: pytest.CaptureFixture[str],
) -> None:
    server = MetricsServer(0, "127.0.0.1")
    try:
        for payload in (
            b"GET /metrics HTTP/1.1\r\n" + b"X-Big: " + b"a" * 60000 + b"\r\n\r\n",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 100,  # TLS hello
            b"POST /metrics HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n",
        ):
            s = _connect(server.port)
            assert s is not None
            s.sendall(payload)
            # The server answers, or ends a request that never completes (no line end
            # in a TLS hello) within its idle timeout (5 s); never later than 10 s.
            s.settimeout(REQUEST_DEADLINE + 5)
            try:
                reply = s.recv(100)
            except ConnectionResetError:
                reply = b""
            s.close()
            assert not reply.startswith(b"HTTP/1.0 200"), reply
        assert scrape(server.port) is not None
    finally:
        server.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
