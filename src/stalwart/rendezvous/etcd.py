"""A small etcd v3 client over etcd's own HTTP/JSON gateway (``/v3/kv/*``, ``/v3/lease/*``).

The rendezvous needs six operations (get, put, create-if-absent, atomic add, lease
grant / keep-alive); the gateway offers them with the standard library alone, so the
launcher needs no gRPC stack.  Every key is prefixed with ``/stalwart/<run id>/``.  Keys
written with ``leased=True`` hang off this client's lease and vanish when the launcher
stops refreshing it, which is how the other nodes learn that it died.

Several comma-separated endpoints may be given (the members of an etcd cluster); a
request that cannot reach one tries the next, so the loss of one etcd member or of any
launcher loses no rendezvous state.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import math
import random
import threading
import time
from typing import Any

from stalwart.rendezvous.api import RendezvousError, StoreLost

logger = logging.getLogger(__name__)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


class EtcdKV:
    """Key-value view of one job's namespace in an etcd cluster."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        run_id: str,
        *,
        lease_ttl: float,
        request_timeout: float = 5.0,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd: at least one endpoint is needed")
        self.endpoints = endpoints
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
    def _post(
        self, path: str, body: dict[str, Any], timeout: float | None = None
    ) -> dict[str, Any]:
        payload = json.dumps(body).encode()
        errors: list[str] = []
        # Unreachable members are skipped; "unavailable" answers (HTTP 503: no leader
        # yet, leader changed) come while the cluster elects a new leader and are
        # retried until the request timeout.
        timeout = self.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        # One member that swallows packets must not eat the whole budget (which is as long
        # as the lease): each try gets a share, and the loop moves on to the next member.
        per_try = max(0.5, min(2.0, timeout / len(self.endpoints)))
        while True:
            for i in range(len(self.endpoints)):
                idx = (self._current + i) % len(self.endpoints)
                host, port = self.endpoints[idx]
                conn = http.client.HTTPConnection(host, port, timeout=per_try)
                try:
                    conn.request("POST", path, payload, {"Content-Type": "application/json"})
                    resp = conn.getresponse()
                    data = resp.read()
                except (OSError, http.client.HTTPException) as err:
                    errors.append(f"{host}:{port}: {err or type(err).__name__}")
                    continue
                finally:
                    conn.close()
                text = data[:200].decode(errors="replace").strip()
                if resp.status == 503:
                    errors.append(f"{host}:{port}: {text}")
                    continue
                self._current = idx
                if resp.status != 200:
                    raise RendezvousError(
                        f"etcd at {host}:{port} refused {path}: HTTP {resp.status} {text}"
                    )
                out: dict[str, Any] = json.loads(data or b"{}")
                return out
            if time.monotonic() > deadline:
                raise StoreLost(f"cannot reach etcd at {self}: {'; '.join(errors[-3:])}")
            time.sleep(0.1)

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


def parse_endpoints(value: str, default_port: int = 2379) -> list[tuple[str, int]]:
    """``"h1:2379,h2"`` (or with ``http://``) -> ``[("h1", 2379), ("h2", 2379)]``."""
    out = []
    for item in filter(None, (p.strip() for p in value.split(","))):
        item = item.removeprefix("http://")
        if item.startswith("https://"):
            raise ValueError(f"--rdzv-endpoint {value!r}: https etcd endpoints are not supported")
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(default_port)
        try:
            out.append((host.strip("[]"), int(port)))
        except ValueError:
            raise ValueError(
                f"--rdzv-endpoint {value!r}: expected HOST[:PORT][,HOST[:PORT]...]"
            ) from None
    if not out:
        raise ValueError(f"--rdzv-endpoint {value!r}: expected HOST[:PORT][,HOST[:PORT]...]")
    return out
