"""The echo server each node runs for link timing, against strangers on its port."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import pytest

from stalwart.health import probe

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def server() -> Iterator[probe.ProbeServer]:
    s = probe.ProbeServer("127.0.0.1")
    yield s
    s.close()


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


def test_a_link_is_timed_and_its_resent_segments_counted(server: probe.ProbeServer) -> None:
    e = probe.time_link(server.address)
    assert e.seconds is not None and 0 < e.seconds < 1
    # Both ends' counts (loopback's 64 KiB MTU makes few, large segments); nothing lost.
    assert e.segments is not None and e.segments.sent >= 2 * (probe.FRAMES + probe.LOSS_FRAMES)
    assert e.segments.resent == 0
    assert all(x.seconds is not None for x in probe.time_links([server.address] * 2))


def test_a_stranger_asking_for_counts_learns_only_its_own_connections(
    server: probe.ProbeServer,
) -> None:
    with _connect(server.address) as c:
        c.sendall(struct.pack("!I", 4) + b"abcd")
        assert c.recv(8) == struct.pack("!I", 4) + b"abcd"
        c.sendall(struct.pack("!I", 0))
        answer = b""
        while chunk := c.recv(64):
            answer += chunk
    # Eight bytes, then the connection closes: this connection's one echoed segment.
    assert probe.counts_of(answer) == probe.Segments(1, 0)
    with _connect(server.address) as c:
        c.sendall(struct.pack("!I", 0))
        assert c.recv(64) == struct.pack("!II", 0, 0) and c.recv(64) == b""


def test_nobody_listening_or_a_bad_address_is_a_broken_link() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert probe.time_link(f"127.0.0.1:{port}", timeout=1) == probe.Echo(None)
    assert probe.time_link("no port here", timeout=1) == probe.Echo(None)
    assert probe.time_link("127.0.0.1:99999", timeout=1) == probe.Echo(None)


def test_an_oversized_frame_is_refused_not_read(server: probe.ProbeServer) -> None:
    with _connect(server.address) as c:
        c.sendall(struct.pack("!I", 2**31))
        assert c.recv(10) == b""  # closed at once
    assert probe.time_link(server.address).seconds is not None


def test_a_silent_stranger_is_dropped_at_the_deadline(server: probe.ProbeServer) -> None:
    with _connect(server.address) as c:
        t0 = time.monotonic()
        assert c.recv(10) == b""
        assert time.monotonic() - t0 < 5


def test_a_flood_of_connections_is_capped_and_the_server_recovers(
    server: probe.ProbeServer,
) -> None:
    held = [_connect(server.address) for _ in range(100)]
    try:
        # Over the cap: closed at once, never a thread each.
        refused = 0
        for c in held[40:]:
            c.settimeout(1)
            try:
                refused += c.recv(1) == b""
            except (TimeoutError, ConnectionResetError):
                pass
        assert refused > 0
    finally:
        for c in held:
            c.close()
    deadline = time.monotonic() + 10
    while probe.time_link(server.address).seconds is None:
        assert time.monotonic() < deadline, "the server did not recover"
        time.sleep(0.1)
