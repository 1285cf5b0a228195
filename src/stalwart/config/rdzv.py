"""``--rdzv-conf``: torch's rendezvous keys, parsed once into a frozen, typed record.

The launcher (``launch/round/membership.py``) turns it into the rendezvous backends' own
settings; nothing downstream reads the ``key=value`` text again.
"""

from __future__ import annotations

import math
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from stalwart.config.endpoints import wants_tls
from stalwart.config.values import ConfigError, parse_kv

# Keys holding a duration, with torch's defaults below.
SECONDS_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "keep_alive_interval",
    "read_timeout",
)
# The keys that configure access to etcd, named as torch's etcd rendezvous names them.
ACCESS_KEYS = ("protocol", "cacert", "cert", "key", "username", "password", "password_file")
# torch's other spellings of the same settings: the etcd backend's total ``timeout``, the
# etcd-v2 store's TLS files.
ALIASES = {
    "timeout": "join_timeout",
    "ca_cert": "cacert",
    "ssl_cert": "cert",
    "ssl_cert_key": "key",
}
# c10d's ``store_type``: stalwart's stores are TCP stores.
STORE_TYPES = ("tcp",)
_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")


@dataclass(frozen=True)
class RendezvousConf:
    """The rendezvous tuning and access ``--rdzv-conf`` asked for (torch's defaults)."""

    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    # torch's meaning: how long one store request may take.  None: the backend's own
    # bound (a static store 30 s; elastic ones the keep-alive's loss time, >= 2 s).
    read_timeout: float | None = None
    # c10d: whether this launcher hosts the store; None: the one on the endpoint's host.
    is_host: bool | None = None
    protocol: str = ""  # etcd: http or https; "": https for https:// endpoints
    cacert: str = ""
    cert: str = ""
    key: str = ""
    username: str = ""
    password: str = field(default="", repr=False)  # never in a log line
    password_file: str = ""

    @property
    def lost_after(self) -> float:
        """Seconds without a keep-alive after which a node counts as lost."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    @classmethod
    def parse(cls, raw: str | Mapping[Any, Any]) -> RendezvousConf:
        """``"join_timeout=60,is_host=1"`` (a flag, the environment) or a YAML mapping."""
        if isinstance(raw, Mapping):
            items = {str(k): str(v) for k, v in raw.items()}
        else:
            items = parse_kv(str(raw), "--rdzv-conf")
        known = [f.name for f in fields(cls)]
        kw: dict[str, Any] = {}
        for given, text in items.items():
            key = ALIASES.get(given, given)
            if key == "store_type":
                if text.strip().lower() not in STORE_TYPES:
                    raise ConfigError(f"--rdzv-conf store_type={text!r}: expected tcp")
                continue
            if key not in known:
                names = sorted([*known, *ALIASES, "store_type"])
                raise ConfigError(f"--rdzv-conf key {given!r}: expected one of {', '.join(names)}")
            if key in kw:
                raise ConfigError(
                    f"--rdzv-conf {given}={text!r}: {key} is already given (torch spells "
                    f"it both ways); expected one of them"
                )
            if key in SECONDS_KEYS:
                kw[key] = _seconds(given, text)
            elif key == "keep_alive_max_attempt":
                if not text.isdigit() or int(text) < 1:
                    raise ConfigError(
                        f"--rdzv-conf keep_alive_max_attempt={text!r}: expected an integer >= 1"
                    )
                kw[key] = int(text)
            elif key == "is_host":
                if text.lower() not in _TRUE + _FALSE:
                    raise ConfigError(f"--rdzv-conf is_host={text!r}: expected 1 or 0")
                kw[key] = text.lower() in _TRUE
            else:
                kw[key] = text
        return cls(**kw)


def _seconds(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--rdzv-conf {key}={text!r}: expected seconds") from None
    if not 0 < value < math.inf:  # also refuses nan
        raise ConfigError(f"--rdzv-conf {key}={text!r}: expected a finite number > 0 of seconds")
    return value


@dataclass(frozen=True)
class EtcdAccessConf:
    """How to reach etcd: plain or TLS (with a CA and a client certificate), as a user."""

    tls: bool = False
    cacert: str = ""
    cert: str = ""
    key: str = ""
    username: str = ""
    password: str = field(default="", repr=False)

    def tls_context(self) -> ssl.SSLContext | None:
        """The TLS context this access needs (None: plain HTTP); a one-line error for
        files that cannot be loaded."""
        if not self.tls:
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.cacert or None)
            if self.cert:
                ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as err:
            raise ConfigError(f"--rdzv-conf TLS files: {err}") from None
        return ctx


def etcd_access(conf: RendezvousConf, endpoint: str) -> EtcdAccessConf:
    """The access *conf* asks for with etcd at *endpoint* (reads ``password_file``)."""
    protocol = (conf.protocol or ("https" if wants_tls(endpoint) else "http")).lower()
    if protocol not in ("http", "https"):
        raise ConfigError(f"--rdzv-conf protocol={protocol!r}: expected http or https")
    if protocol == "http" and wants_tls(endpoint):
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: https endpoints with protocol=http")
    if bool(conf.cert) != bool(conf.key):
        raise ConfigError("--rdzv-conf cert and key: expected both (a client certificate)")
    if protocol == "http" and (conf.cacert or conf.cert or conf.key):
        raise ConfigError("--rdzv-conf cacert/cert/key: expected protocol=https")
    password = conf.password
    if conf.password_file:
        if password:
            raise ConfigError("--rdzv-conf: expected password or password_file, not both")
        try:
            password = Path(conf.password_file).read_text().rstrip("\n")
        except OSError as err:
            raise ConfigError(
                f"--rdzv-conf password_file={conf.password_file!r}: {err.strerror}"
            ) from None
    if password and not conf.username:
        raise ConfigError("--rdzv-conf password: expected a username too")
    return EtcdAccessConf(
        tls=protocol == "https",
        cacert=conf.cacert,
        cert=conf.cert,
        key=conf.key,
        username=conf.username,
        password=password,
    )
