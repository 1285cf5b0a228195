"""``--rdzv-conf`` and ``--rdzv-endpoint`` parsed once into typed values; the launcher's
translation of them into the rendezvous' own settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stalwart.cli import build_config
from stalwart.config import (
    ConfigError,
    Endpoint,
    RendezvousConf,
    etcd_access,
    parse_endpoint,
    parse_endpoints,
)
from stalwart.launch.round.membership import elastic_settings, store_request_timeout
from stalwart.rendezvous.static import OP_TIMEOUT

pytestmark = pytest.mark.timeout(60)

_VALID: list[tuple[str | dict[str, Any], dict[str, Any]]] = [
    ("", {}),
    ("join_timeout=60", {"join_timeout": 60.0}),
    ("is_host=1,keep_alive_max_attempt=5", {"is_host": True, "keep_alive_max_attempt": 5}),
    ("is_host=No", {"is_host": False}),
    ("read_timeout=7.5", {"read_timeout": 7.5}),
    ({"join_timeout": 30, "is_host": True}, {"join_timeout": 30.0, "is_host": True}),
    ("username=u,password_file=/p", {"username": "u", "password_file": "/p"}),
    # torch's other spellings: etcd's total timeout, the etcd-v2 store's TLS files
    ("timeout=900", {"join_timeout": 900.0}),
    ("ca_cert=/ca,ssl_cert=/c,ssl_cert_key=/k", {"cacert": "/ca", "cert": "/c", "key": "/k"}),
    ("store_type=TCP,join_timeout=5", {"join_timeout": 5.0}),
]


@pytest.mark.parametrize(("raw", "want"), _VALID)
def test_parse(raw: str | dict[str, Any], want: dict[str, Any]) -> None:
    assert RendezvousConf.parse(raw) == RendezvousConf(**want)


_INVALID = [
    ("join_timeout", "expected key=value"),
    ("heartbeat=1", "--rdzv-conf key 'heartbeat'"),
    ("is_host=maybe", "is_host='maybe'"),
    ("keep_alive_interval=nan", "keep_alive_interval='nan'"),
    ("close_timeout=-1", "close_timeout='-1'"),
    ("keep_alive_max_attempt=0", "keep_alive_max_attempt='0'"),
    ("read_timeout=soon", "read_timeout='soon': expected seconds"),
    ("store_type=file", "store_type='file': expected tcp"),
    ("timeout=5,join_timeout=6", "join_timeout is already given"),
    ("timeout=never", "timeout='never': expected seconds"),
]


@pytest.mark.parametrize(("raw", "needle"), _INVALID)
def test_parse_errors_name_the_value(raw: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        RendezvousConf.parse(raw)
    assert "\n" not in str(info.value)


def test_read_timeout_is_checked_on_the_command_line() -> None:
    """It was accepted and ignored; now it is torch's store-request bound, so checked."""
    with pytest.raises(ConfigError, match="read_timeout='abc'"):
        build_config(["--rdzv-conf", "read_timeout=abc", "x.py"])


# (conf, elastic) -> seconds one store request may take
_REQUEST = [
    (RendezvousConf(), False, OP_TIMEOUT),
    (RendezvousConf(), True, 15.0),  # keep-alive 5 s x 3 attempts
    (RendezvousConf(keep_alive_interval=0.5, keep_alive_max_attempt=2), True, 2.0),
    (RendezvousConf(read_timeout=7.0), False, 7.0),
    (RendezvousConf(read_timeout=7.0), True, 7.0),
]


@pytest.mark.parametrize(("conf", "elastic", "want"), _REQUEST)
def test_store_request_timeout(conf: RendezvousConf, elastic: bool, want: float) -> None:
    assert store_request_timeout(conf, elastic) == want


def test_elastic_settings_come_from_the_typed_conf() -> None:
    cfg, _ = build_config(
        [
            "--nnodes",
            "1:3",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "localhost:29999",
            "--max-restarts",
            "2",
            "--rdzv-conf",
            "join_timeout=9,last_call_timeout=1,close_timeout=2,keep_alive_interval=0.5,"
            "keep_alive_max_attempt=4",
            "x.py",
        ]
    )
    s = elastic_settings(cfg)
    assert (s.min_nodes, s.max_nodes, s.max_restarts) == (1, 3, 2)
    assert (s.join_timeout, s.last_call_timeout, s.close_timeout) == (9.0, 1.0, 2.0)
    assert (s.keep_alive_interval, s.keep_alive_max_attempt) == (0.5, 4)
    assert cfg.store_endpoints == (Endpoint("localhost", 29999),)


# (backend, endpoint text) -> the endpoints the launcher gets
_ENDPOINTS = [
    ("c10d", "h", [("h", 29400)]),
    ("c10d", "[::1]:5", [("::1", 5)]),
    ("static", "h", [("h", 29500)]),  # a static job's default: --master-port
    ("etcd", "https://a:1,b", [("a", 1), ("b", 2379)]),
]


@pytest.mark.parametrize(("backend", "text", "want"), _ENDPOINTS)
def test_endpoints_parsed_once_for_the_backend(
    backend: str, text: str, want: list[tuple[str, int]]
) -> None:
    argv = ["--nnodes", "2", "--node-rank", "0", "--rdzv-backend", backend]
    cfg, _ = build_config([*argv, "--rdzv-endpoint", text, "x.py"])
    assert list(cfg.store_endpoints) == want


def test_endpoint_parsers() -> None:
    assert parse_endpoint("h:7") == Endpoint("h", 7) and str(Endpoint("h", 7)) == "h:7"
    assert parse_endpoints("http://e") == [Endpoint("e", 2379)]
    for bad in ("h:x", ""):
        with pytest.raises(ValueError, match="--rdzv-endpoint"):
            parse_endpoints(bad) if bad == "" else parse_endpoint(bad)


def test_etcd_access(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("secret\n")
    conf = RendezvousConf.parse(f"username=root,password_file={pw}")
    access = etcd_access(conf, "e:2379")
    assert (access.tls, access.username, access.password) == (False, "root", "secret")
    assert "secret" not in repr(access) and "secret" not in repr(
        RendezvousConf(username="u", password="secret")
    )
    assert etcd_access(RendezvousConf(), "https://e:2379").tls
    with pytest.raises(ConfigError, match="No such file"):
        etcd_access(RendezvousConf(username="u", password_file=str(tmp_path / "no")), "e")
    with pytest.raises(ConfigError, match="expected http or https"):
        etcd_access(RendezvousConf(protocol="ftp"), "e")
