"""Timing a link between two nodes: a bounded echo server, and the client that times it.

Each node runs a `ProbeServer` on the address its peers reach it at. A peer sends a few
frames of `PAYLOAD` bytes and times the echoes; the best of them is the link's time.
The server answers anyone (it returns only what it was sent, so it leaks and amplifies
nothing) but bounds everything a stranger could exhaust: concurrent connections, the
frame size, frames per connection, and each connection's time.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

PAYLOAD = 16 * 1024
FRAMES = 3
_MAX_FRAME = 64 * 1024
_MAX_FRAMES_PER_CONN = 8
_MAX_CONNS = 32
_CONN_S = 2.0
_HEAD = struct.Struct("!I")


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
                if n == 0 or n > _MAX_FRAME:
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


def time_link(address: str, timeout: float = _CONN_S) -> float | None:
    """The best echo time of `FRAMES` frames to the server at *address*; None when it
    cannot be reached or answers wrong within *timeout*."""
    try:
        host, port = _split(address)
    except ValueError:
        return None
    deadline = time.monotonic() + timeout
    payload = bytes(PAYLOAD)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            best = float("inf")
            for _ in range(FRAMES):
                t0 = time.perf_counter()
                sock.sendall(_HEAD.pack(PAYLOAD) + payload)
                (n,) = _HEAD.unpack(_recv_exact(sock, _HEAD.size, deadline))
                if n != PAYLOAD or _recv_exact(sock, n, deadline) != payload:
                    return None
                best = min(best, time.perf_counter() - t0)
            return best
    except (OSError, ConnectionError, struct.error):
        return None


def time_links(addresses: Sequence[str], timeout: float = _CONN_S) -> list[float | None]:
    """`time_link` to each of *addresses*, side by side."""
    if not addresses:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
        return list(pool.map(lambda a: time_link(a, timeout), addresses))
