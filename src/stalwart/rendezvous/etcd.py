"""A small etcd v3 client over etcd's own HTTP/JSON gateway (``/v3/kv/*``, ``/v3/lease/*``).

The rendezvous needs six operations (get, put, create-if-absent, atomic add, lease
grant / keep-alive); the gateway offers them with the standard library alone, so the
launcher needs no gRPC stack.  Every key is prefixed with ``/stalwart/<run id>/``.  Keys
written with ``leased=True`` hang off this client's lease and vanish when the launcher
stops refreshing it, which is how the other nodes learn that it died.

Several comma-separated endpoints may be given (the members of an etcd cluster); a
request that cannot reach one tries the next, so the loss of one etcd member or of any
launcher loses no rendezvous state.

Access control is etcd's own (`EtcdAccess`, which the launcher makes from
``--rdzv-conf``): a username and password take a token from ``/v3/auth/authenticate`` and send it with every
request (a new one is taken when etcd says it expired); ``protocol=https`` (or
``https://`` endpoints) with ``cacert`` and, for client-certificate auth, ``cert`` and
``key`` — the key names torch's etcd rendezvous uses.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import math
import random
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from stalwart.rendezvous.api import RendezvousError, StoreLost

logger = logging.getLogger(__name__)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


@dataclass(frozen=True)
class EtcdAccess:
    """How to reach etcd: plain or TLS, anonymous or as a user."""

    tls: ssl.SSLContext | None = None
    username: str = ""
    password: str = field(default="", repr=False)


class EtcdKV:
    """Key-value view of one job's namespace in an etcd cluster."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        run_id: str,
        *,
        lease_ttl: float,
        request_timeout: float = 5.0,
        access: EtcdAccess | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd: at least one endpoint is needed")
        self.endpoints = endpoints
        self._access = access or EtcdAccess()
        self._token: str | None = None
        # Its own lock: _ensure_lease posts while holding self._lock.
        self._token_lock = threading.Lock()
        self.prefix = f"/stalwart/{run_id}/"
        self.request_timeout = request_timeout
        self._ttl = max(2, math.ceil(lease_ttl))
        # Launchers spread over the members, so one that hangs stalls only some of them.
        self._current = random.randrange(len(endpoints))
        self._lock = threading.Lock()
        self._lease: str | None = None
        self._leased: dict[str, str] = {}  # re-put after the lease had to be re-granted

    def __str__(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    # -- transport ---------------------------------------------------------------------
    def _connection(self, host: str, port: int, timeout: float) -> http.client.HTTPConnection:
        if self._access.tls is not None:
            return http.client.HTTPSConnection(
                host, port, timeout=timeout, context=self._access.tls
            )
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def _authenticate(self) -> str:
        """A token for the configured user (etcd's simple tokens expire: taken anew then)."""
        a = self._access
        resp = self._send(
            "/v3/auth/authenticate", {"name": a.username, "password": a.password}, None, None
        )
        token = resp.get("token")
        if not isinstance(token, str) or not token:
            raise RendezvousError(f"etcd at {self} gave no token for user {a.username!r}")
        return token

    def _post(
        self, path: str, body: dict[str, Any], timeout: float | None = None
    ) -> dict[str, Any]:
        if not self._access.username:
            return self._send(path, body, timeout, None)
        for fresh in (False, True):
            with self._token_lock:
                token = self._token
            if token is None or fresh:
                token = self._authenticate()
                with self._token_lock:
                    self._token = token
            try:
                return self._send(path, body, timeout, token)
            except _TokenRejected:
                if fresh:
                    break
        raise RendezvousError(
            f"etcd at {self} keeps refusing the token of {self._access.username!r}"
        )

    def _send(
        self, path: str, body: dict[str, Any], timeout: float | None, token: str | None
    ) -> dict[str, Any]:
        payload = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = token
        errors: list[str] = []
        # Unreachable members are skipped; "unavailable" answers (HTTP 503: no leader
        # yet, leader changed) come while the cluster elects a new leader and are
        # retried until the request timeout.
        timeout = self.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        # One member that swallows packets must not eat the whole budget (which is as long
        # as the lease): each try gets a share, and the loop moves on to the next member.
        per_try = max(0.5, min(2.0, timeout / len(self.endpoints)))
        refused: set[int] = set()
        while True:
            for i in range(len(self.endpoints)):
                idx = (self._current + i) % len(self.endpoints)
                host, port = self.endpoints[idx]
                conn = self._connection(host, port, per_try)
                try:
                    conn.request("POST", path, payload, headers)
                    resp = conn.getresponse()
                    data = resp.read()
                except (OSError, http.client.HTTPException) as err:
                    errors.append(f"{host}:{port}: {err or type(err).__name__}")
                    if _certificate_refused(err):
                        refused.add(idx)
                    continue
                finally:
                    conn.close()
                text = data[:200].decode(errors="replace").strip()
                if resp.status == 503:
                    errors.append(f"{host}:{port}: {text}")
                    continue
                self._current = idx
                if token is not None and "invalid auth token" in text:
                    raise _TokenRejected(text)
                if resp.status != 200:
                    raise RendezvousError(self._refusal(f"{host}:{port}", path, resp.status, data))
                out: dict[str, Any] = json.loads(data or b"{}")
                return out
            if len(refused) == len(self.endpoints):
                # A certificate refused by every member is refused on every retry: a final
                # refusal, like bad credentials, not a store that may come back.
                raise RendezvousError(f"cannot reach etcd at {self}: {errors[-1]}")
            if time.monotonic() > deadline:
                raise StoreLost(f"cannot reach etcd at {self}: {'; '.join(errors[-3:])}")
            time.sleep(0.1)

    def _refusal(self, where: str, path: str, status: int, data: bytes) -> str:
        try:
            why = str(json.loads(data).get("message", ""))
        except (ValueError, AttributeError):
            why = ""
        why = why or data[:200].decode(errors="replace").strip()
        line = f"etcd at {where} refused {path}: HTTP {status} {why}"
        if "user name is empty" in why:
            line += " (etcd has authentication on: --rdzv-conf username=...,password_file=...)"
        return line

    def ping(self, timeout: float | None = None) -> None:
        """Raises ``StoreLost`` if no endpoint answers within *timeout*."""
        self._post("/v3/maintenance/status", {}, timeout)

    # -- keys --------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return _b64(self.prefix + key)

    def get(self, key: str) -> bytes | None:
        kvs = self._post("/v3/kv/range", {"key": self._key(key)}).get("kvs")
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        # etcd refuses transactions of more than 128 operations by default.
        for start in range(0, len(keys), 128):
            ops = [{"request_range": {"key": self._key(k)}} for k in keys[start : start + 128]]
            resp = self._post("/v3/kv/txn", {"success": ops})
            for r in resp.get("responses", []):
                kvs = r.get("response_range", {}).get("kvs")
                out.append(_unb64(kvs[0].get("value", "")) if kvs else None)
        return out

    def set(self, key: str, value: str, *, leased: bool = False) -> None:
        body: dict[str, Any] = {"key": self._key(key), "value": _b64(value)}
        if not leased:
            self._post("/v3/kv/put", body)
            return
        with self._lock:
            self._leased[key] = value
        body["lease"] = self._ensure_lease()
        try:
            self._post("/v3/kv/put", body)
        except RendezvousError as err:
            if "lease not found" not in str(err):
                raise
            # Expired while this node could not reach etcd: take a new one and retry.
            with self._lock:
                self._lease = None
            body["lease"] = self._ensure_lease()
            self._post("/v3/kv/put", body)

    def create(self, key: str, value: str) -> bytes:
        """Writes *value* if *key* is absent; returns what the key holds afterwards."""
        k = self._key(key)
        resp = self._post(
            "/v3/kv/txn",
            {
                "compare": [
                    {"key": k, "target": "CREATE", "create_revision": "0", "result": "EQUAL"}
                ],
                "success": [{"request_put": {"key": k, "value": _b64(value)}}],
                "failure": [{"request_range": {"key": k}}],
            },
        )
        if resp.get("succeeded"):
            return value.encode()
        kvs = resp["responses"][0]["response_range"].get("kvs") or [{}]
        return _unb64(kvs[0].get("value", ""))

    def add(self, key: str, amount: int) -> int:
        """Atomic counter: optimistic read-modify-write on the key's mod revision."""
        k = self._key(key)
        while True:
            kvs = self._post("/v3/kv/range", {"key": k}).get("kvs")
            if kvs:
                current = int(_unb64(kvs[0].get("value", "")) or b"0")
                guard = {
                    "key": k,
                    "target": "MOD",
                    "mod_revision": kvs[0]["mod_revision"],
                    "result": "EQUAL",
                }
            else:
                current = 0
                guard = {"key": k, "target": "CREATE", "create_revision": "0", "result": "EQUAL"}
            if amount == 0:
                return current
            new = current + amount
            resp = self._post(
                "/v3/kv/txn",
                {
                    "compare": [guard],
                    "success": [{"request_put": {"key": k, "value": _b64(str(new))}}],
                },
            )
            if resp.get("succeeded"):
                return new

    # -- lease -------------------------------------------------------------------------
    def _ensure_lease(self) -> str:
        with self._lock:
            if self._lease is None:
                resp = self._post("/v3/lease/grant", {"TTL": self._ttl})
                self._lease = str(resp["ID"])
            return self._lease

    def refresh(self) -> None:
        """Keeps this node's leased keys alive; re-grants and re-writes them if the lease
        expired meanwhile (e.g. after a network blip shorter than the launcher's patience)."""
        lease = self._ensure_lease()
        resp = self._post("/v3/lease/keepalive", {"ID": lease})
        if int(resp.get("result", {}).get("TTL", 0)) > 0:
            return
        logger.warning("etcd lease %s expired; re-registering this node", lease)
        with self._lock:
            self._lease = None
            again = dict(self._leased)
        for key, value in again.items():
            self.set(key, value, leased=True)

    def close(self) -> None:
        """Drops the lease, so this node's leased keys go at once rather than after the TTL."""
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            try:
                self._post("/v3/lease/revoke", {"ID": lease})
            except (RendezvousError, OSError, ValueError) as err:
                logger.debug("lease revoke: %s", err)


class _TokenRejected(RendezvousError):
    """etcd no longer accepts the token (expired, or the server restarted)."""


def _certificate_refused(err: BaseException) -> bool:
    """A TLS handshake that failed over a certificate (ours untrusted by the server, or
    the server's by us), as opposed to a connection cut mid-handshake."""
    if isinstance(err, ssl.SSLCertVerificationError):
        return True
    return isinstance(err, ssl.SSLError) and "CERTIFICATE" in str(err.reason or "").upper()
