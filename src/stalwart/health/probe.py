"""Timing a link between two nodes: a bounded echo server, and the client that times it.

Each node runs a `ProbeServer` on the address its peers reach it at. A peer sends a few
frames of `PAYLOAD` bytes and times the echoes; the best of them is the link's time.
The server answers anyone (it returns only what it was sent, so it leaks and amplifies
nothing) but bounds everything a stranger could exhaust: concurrent connections, the
frame size, frames per connection, and each connection's time.

The best time hides random loss: TCP resends a lost segment within a round trip, and
one clean try of three is enough. So the prober also sends `LOSS_FRAMES` larger frames
and counts what TCP had to resend on the connection, both ways: its own socket's
``TCP_INFO`` for what it sent, and, asked with an empty frame at the end, the server's
for what it echoed (the only answer that is not an echo: the asker's own connection's
two counters, nothing about anyone else's).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from stalwart.health.records import SEGMENTS_LIMIT

logger = logging.getLogger(__name__)

PAYLOAD = 16 * 1024
FRAMES = 3
#: Frames of `_MAX_FRAME` bytes sent after the timed ones, for their resent segments:
#: about 180 wire-sized segments each way, enough to tell a few percent of loss from none.
LOSS_FRAMES = 4
_MAX_FRAME = 64 * 1024
_MAX_FRAMES_PER_CONN = 8
_MAX_CONNS = 32
_CONN_S = 2.0
_HEAD = struct.Struct("!I")
#: The server's answer to an empty frame: its segments resent and data segments sent.
_COUNTS = struct.Struct("!II")
# ``struct tcp_info`` (linux/tcp.h) up to ``tcpi_data_segs_out`` (Linux 4.6): the fields
# read are ``tcpi_total_retrans`` (segments resent, tail-loss probes included) and
# ``tcpi_data_segs_out`` (data segments sent, resent ones included), both in segments of
# the path's MSS whatever the NIC's offloads made of them.
_TCP_INFO = struct.Struct("=8B24I4Q6I")
_TOTAL_RETRANS = 8 + 23  # after the eight bytes, the 24th u32
_DATA_SEGS_OUT = -1  # the last field of that prefix


@dataclass(frozen=True)
class Segments:
    """Data segments sent on a connection, and how many of them were resent."""

    sent: int
    resent: int

    def __add__(self, other: Segments) -> Segments:
        return Segments(self.sent + other.sent, self.resent + other.resent)


@dataclass(frozen=True)
class Echo:
    """One link as a prober saw it: the best echo time (None: it could not be reached,
    or answered wrong, within the bound) and the segments TCP sent and resent on the
    connection, both ways where the server told its half (None: not known)."""

    seconds: float | None
    segments: Segments | None = None


def tcp_segments(sock: socket.socket) -> Segments | None:
    """What the kernel counted on *sock*; None where it cannot tell (not TCP, an old
    kernel's shorter ``tcp_info``)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
    except OSError:
        return None
    if len(raw) < _TCP_INFO.size:
        return None
    fields = _TCP_INFO.unpack(raw)
    return Segments(sent=fields[_DATA_SEGS_OUT], resent=fields[_TOTAL_RETRANS])


def counts_of(raw: bytes) -> Segments | None:
    """The server's half as it answered (None: not a plausible count, so not used)."""
    if len(raw) != _COUNTS.size:
        return None
    sent, resent = _COUNTS.unpack(raw)
    if sent > SEGMENTS_LIMIT or resent > sent:
        return None
    return Segments(sent, resent)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("probe deadline")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


class ProbeServer:
    """Echoes length-prefixed frames, in a thread, until `close`."""

    def __init__(self, addr: str) -> None:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((addr, 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.address = f"{addr}:{self._sock.getsockname()[1]}"
        self._slots = threading.BoundedSemaphore(_MAX_CONNS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="stalwart-probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()  # over the limit: the prober sees a broken link, not a hang
                continue
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + _CONN_S
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(_MAX_FRAMES_PER_CONN):
                (n,) = _HEAD.unpack(_recv_exact(conn, _HEAD.size, deadline))
                if n > _MAX_FRAME:
                    return
                if n == 0:  # the prober's last word: what this end resent of its echoes
                    mine = tcp_segments(conn) or Segments(0, 0)
                    sent = min(mine.sent, SEGMENTS_LIMIT)
                    conn.sendall(_COUNTS.pack(sent, min(mine.resent, sent)))
                    return
                conn.sendall(_HEAD.pack(n) + _recv_exact(conn, n, deadline))
        except (OSError, ConnectionError, struct.error):
            return
        finally:
            conn.close()
            self._slots.release()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=1.0)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _echo(sock: socket.socket, payload: bytes, deadline: float) -> float | None:
    """Seconds for one frame's echo; None: a wrong answer."""
    t0 = time.perf_counter()
    sock.sendall(_HEAD.pack(len(payload)) + payload)
    (n,) = _HEAD.unpack(_recv_exact(sock, _HEAD.size, deadline))
    if n != len(payload) or _recv_exact(sock, n, deadline) != payload:
        return None
    return time.perf_counter() - t0


def time_link(address: str, timeout: float = _CONN_S) -> Echo:
    """The best echo time of `FRAMES` frames to the server at *address* (None when it
    cannot be reached or answers wrong within *timeout*), and the segments resent on
    the connection. The loss frames go after the timed ones, within what is left of
    *timeout*: on a slow link the time is known even when they do not finish, and the
    segments this end counted until then still are."""
    try:
        host, port = _split(address)
    except ValueError:
        return Echo(None)
    deadline = time.monotonic() + timeout
    payload = bytes(PAYLOAD)
    best: float | None = None
    mine: Segments | None = None
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                times = [_echo(sock, payload, deadline) for _ in range(FRAMES)]
                if None in times:
                    return Echo(None)
                best = min(t for t in times if t is not None)
                big = bytes(_MAX_FRAME)
                for _ in range(LOSS_FRAMES):
                    if _echo(sock, big, deadline) is None:
                        return Echo(best)
                mine = tcp_segments(sock)
                sock.sendall(_HEAD.pack(0))
                theirs = counts_of(_recv_exact(sock, _COUNTS.size, deadline))
                if mine is None or theirs is None:
                    return Echo(best, mine)
                return Echo(best, mine + theirs)
            except (OSError, ConnectionError, struct.error):
                # Cut short (its deadline, a reset): what this end counted still shows.
                return Echo(best, mine if mine is not None else tcp_segments(sock))
    except (OSError, ConnectionError):
        return Echo(None)


def time_links(addresses: Sequence[str], timeout: float = _CONN_S) -> list[Echo]:
    """`time_link` to each of *addresses*, side by side."""
    if not addresses:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
        return list(pool.map(lambda a: time_link(a, timeout), addresses))
