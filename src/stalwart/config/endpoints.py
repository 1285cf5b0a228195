"""``--rdzv-endpoint`` values: one store's ``HOST[:PORT]``, or an etcd cluster's list."""

from __future__ import annotations

from typing import NamedTuple

C10D_PORT = 29400  # torchrun's default port of a c10d rendezvous store
ETCD_PORT = 2379


class Endpoint(NamedTuple):
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(value: str, default_port: int = C10D_PORT) -> Endpoint:
    """``"h:29400"``, ``"[::1]:5"`` or ``"h"`` (the default port) -> an `Endpoint`."""
    host, sep, port = value.rpartition(":")
    if not sep:
        return Endpoint(value, default_port)
    try:
        return Endpoint(host.strip("[]"), int(port))
    except ValueError:
        raise ValueError(f"--rdzv-endpoint {value!r}: expected HOST[:PORT]") from None


def parse_endpoints(value: str, default_port: int = ETCD_PORT) -> list[Endpoint]:
    """``"h1:2379,h2"`` (or with ``http://``/``https://``) -> ``[("h1", 2379), ("h2", 2379)]``;
    whether TLS is wanted is `wants_tls`'s business."""
    out = []
    for item in filter(None, (p.strip() for p in value.split(","))):
        item = item.removeprefix("http://").removeprefix("https://")
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(default_port)
        try:
            out.append(Endpoint(host.strip("[]"), int(port)))
        except ValueError:
            raise ValueError(
                f"--rdzv-endpoint {value!r}: expected HOST[:PORT][,HOST[:PORT]...]"
            ) from None
    if not out:
        raise ValueError(f"--rdzv-endpoint {value!r}: expected HOST[:PORT][,HOST[:PORT]...]")
    return out


def wants_tls(value: str) -> bool:
    """An ``https://`` endpoint asks for TLS as ``protocol=https`` does."""
    return "https://" in value
