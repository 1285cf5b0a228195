"""The HTTP side of ``--metrics-port``: a small server that no peer can starve.

It answers ``GET /metrics`` (and ``/``) from a prometheus-client registry and nothing
else. Whoever reaches the port is a stranger, so:

* at most ``MAX_CONNECTIONS`` are served at once, ``MAX_PER_PEER`` from one address;
  one more is accepted and closed at once (the launcher's descriptors stay bounded,
  whatever the flood, and one flooding host leaves room for the others);
* a connection gets ``REQUEST_DEADLINE`` seconds in all, and ``IDLE_TIMEOUT`` between
  two bytes; a slow or silent peer (slowloris) is cut off, never waited for;
* a request's line and headers are at most ``MAX_REQUEST`` bytes in all;
* a malformed request is logged as one line, at most one every ``LOG_EVERY`` seconds
  with a count of the ones left out.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from stalwart.base.records import printable

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 32
MAX_PER_PEER = 8
REQUEST_DEADLINE = 10.0
IDLE_TIMEOUT = 5.0
LOG_EVERY = 60.0
MAX_REQUEST = 16384


class RateLimitedLog:
    """One warning line per *every* seconds; the lines left out are counted in the next."""

    def __init__(self, log: logging.Logger, every: float = LOG_EVERY) -> None:
        self._log = log
        self._every = every
        self._next = 0.0
        self._held = 0
        self._lock = threading.Lock()

    def warning(self, text: str) -> bool:
        """Logs *text* unless one was logged less than *every* seconds ago; True if it was."""
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._held += 1
                return False
            held, self._held = self._held, 0
            self._next = now + self._every
        more = f" ({held} more like it in the last {self._every:g} s)" if held else ""
        self._log.warning("%s%s", printable(text[:300]), more)
        return True


class _Handler(BaseHTTPRequestHandler):
    server: MetricsHTTPServer
    timeout = IDLE_TIMEOUT  # between two bytes (StreamRequestHandler sets it on the socket)
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive

    def setup(self) -> None:
        super().setup()
        self.rfile = _CappedReader(self.rfile)  # type: ignore[assignment]

    def do_GET(self) -> None:
        if urlsplit(self.path).path not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served here")
            return
        try:
            body = generate_latest(self.server.registry)
        except Exception as err:  # a collector's bug must not end the server
            logger.error("metrics: the scrape failed: %s", err)
            self.send_error(500, "the metrics could not be computed")
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # a scrape every few seconds is not news

    def log_error(self, format: str, *args: Any) -> None:
        peer = self.client_address[0] if self.client_address else "?"
        self.server.bad_input.warning(f"metrics: bad request from {peer}: {format % args}")


class _CappedReader:
    """The request's input, ended with an error once it passes MAX_REQUEST bytes (a
    GET needs a few hundred; the standard library alone allows 100 lines of 64 KiB)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._left = MAX_REQUEST

    def readline(self, size: int = -1) -> bytes:
        cap = self._left + 1 if size < 0 else min(size, self._left + 1)
        line: bytes = self._raw.readline(cap)
        self._left -= len(line)
        if self._left < 0:
            raise ConnectionAbortedError(f"a request larger than {MAX_REQUEST} bytes")
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class MetricsHTTPServer(ThreadingMixIn, HTTPServer):
    """Serves a registry with bounded connections and deadlines (module docstring)."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128  # a burst waits in the kernel; the cap applies on accept

    def __init__(self, addr: tuple[str, int], registry: CollectorRegistry) -> None:
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        super().__init__(addr, _Handler)
        self.registry = registry
        self.bad_input = RateLimitedLog(logger)
        self.refused = 0
        self._active: dict[socket.socket, tuple[float, str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(
            target=self._reap, name="stalwart-metrics-deadlines", daemon=True
        )
        self._reaper.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = str(client_address[0])
        with self._lock:
            from_peer = sum(1 for _, p in self._active.values() if p == peer)
            full = len(self._active) >= MAX_CONNECTIONS or from_peer >= MAX_PER_PEER
            if not full:
                self._active[request] = (time.monotonic() + REQUEST_DEADLINE, peer)
        if full:
            self.refused += 1
            self.bad_input.warning(
                f"metrics: too many connections open ({from_peer} from {peer}, "
                f"{MAX_CONNECTIONS} at most in all, {MAX_PER_PEER} from one address); "
                "closed one more"
            )
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._active.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A peer that vanished, was cut off or sent too much: one line, not a traceback.
        err = sys.exc_info()[1]
        self.bad_input.warning(f"metrics: connection from {client_address[0]} ended: {err}")

    def _reap(self) -> None:
        """Cuts off connections past their deadline: their thread's read then fails."""
        while not self._stop.wait(0.5):
            now = time.monotonic()
            with self._lock:
                late = [s for s, (deadline, _) in self._active.items() if deadline <= now]
            for sock in late:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.shutdown()
        self.server_close()
        with self._lock:
            late = list(self._active)
        for sock in late:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._reaper.join(timeout=2)


def serve(
    port: int, addr: str, registry: CollectorRegistry
) -> tuple[MetricsHTTPServer, threading.Thread]:
    """Binds (OSError when the port is taken) and serves in a daemon thread."""
    server = MetricsHTTPServer((addr, port), registry)
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.5},
        name="stalwart-metrics",
        daemon=True,
    )
    thread.start()
    return server, thread
