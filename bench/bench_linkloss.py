"""What random loss on one node's link looks like to the echo link check and to the kernel.

Two simulated hosts (network namespaces, ``bench/netns.py``); the prober's link drops N %
of its packets either way (``Network.lose``: nftables on the root side of its veth, on
the wire). For each N, ``--connections`` probes of the health check's echo server
(``stalwart.health.probe``), each printed as: the best and the worst of its three timed
16 KiB echoes, what TCP resent of the segments sent both ways (the probe's counts), and
the lossy namespace's own counters over all of them (``/proc/net/snmp`` RetransSegs and
OutSegs, ``/proc/net/netstat`` TCPOFOQueue: per network namespace, so per node).

Needs root and nft. ``python bench/bench_linkloss.py [--loss 0,5,10,20] [--connections 10]``
(about 30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from netns import Host, Network, netns_usable  # noqa: E402

SERVER = (
    "import sys, time; from stalwart.health.probe import ProbeServer; "
    "s = ProbeServer(sys.argv[1]); print(s.address, flush=True); time.sleep(600)"
)
# In the lossy host: the probe as the check runs it, with each timed echo kept.
CLIENT = """
import json, sys, time
from stalwart.health import probe
times = []
real = probe._echo
def timed(sock, payload, deadline):
    t = real(sock, payload, deadline)
    if len(payload) == probe.PAYLOAD:
        times.append(t)
    return t
probe._echo = timed
out = []
for _ in range(int(sys.argv[2])):
    times.clear()
    e = probe.time_link(sys.argv[1])
    seg = None if e.segments is None else [e.segments.resent, e.segments.sent]
    out.append({"times": [t for t in times if t is not None], "segments": seg})
print(json.dumps(out))
"""
KEYS = ("Tcp:RetransSegs", "Tcp:OutSegs", "TcpExt:TCPOFOQueue", "TcpExt:TCPTimeouts")


def counters(host: Host) -> dict[str, int]:
    text = subprocess.run(
        host.cmd("cat", "/proc/net/snmp", "/proc/net/netstat"), capture_output=True, text=True
    ).stdout.splitlines()
    found: dict[str, int] = {}
    for names, values in zip(text[::2], text[1::2], strict=False):
        head, *ks = names.split()
        for k, v in zip(ks, values.split()[1:], strict=False):
            found[head + k] = int(v)
    return {k: found.get(k, 0) for k in KEYS}


def ms(t: float) -> str:
    return f"{t * 1e3:.3g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loss", default="0,5,10,20")
    ap.add_argument("--connections", type=int, default=10)
    args = ap.parse_args()
    if why := netns_usable():
        print(f"skipped: {why}")
        return 0
    print(f"load: {os.getloadavg()[0]:.2f}")
    net = Network(f"{os.getpid() % 10000}")
    server = None
    try:
        peer, lossy = net.add_host(), net.add_host()
        server = subprocess.Popen(
            peer.cmd(sys.executable, "-c", SERVER, peer.addr), stdout=subprocess.PIPE, text=True
        )
        assert server.stdout is not None
        address = server.stdout.readline().strip()
        for loss in (int(x) for x in args.loss.split(",")):
            subprocess.run(["nft", "delete", "table", "netdev", f"swloss{lossy.veth}"],
                           capture_output=True)  # fmt: skip
            net.lose(lossy, loss)
            before = counters(lossy)
            run = subprocess.run(
                lossy.cmd(sys.executable, "-c", CLIENT, address, str(args.connections)),
                capture_output=True,
                text=True,
            )
            after = counters(lossy)
            print(f"\n== {loss} % loss, {args.connections} probes (load {os.getloadavg()[0]:.2f})")
            if run.returncode != 0:
                print(run.stderr[-800:])
                continue
            for i, probe in enumerate(json.loads(run.stdout)):
                t = probe["times"]
                seg = probe["segments"]
                timed = f"best {ms(min(t))} ms, worst {ms(max(t))} ms" if len(t) == 3 else "cut"
                counted = "not counted" if seg is None else f"resent {seg[0]} of {seg[1]}"
                print(f"  probe {i}: {timed}; {counted}")
            print("  lossy namespace:", {k: after[k] - before[k] for k in KEYS})
    finally:
        if server is not None:
            server.kill()
            server.wait()
        net.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
