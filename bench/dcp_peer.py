"""bench_dcp.py's ``peer`` section: restore from a peer's replica vs ``dcp.load``.

Three simulated hosts (network namespaces, ``bench/netns.py``; root only): an FSDP2 job
(``bench/dcp_peer_job.py``), one rank per node, ``stalwart run --ckpt-ram
--ckpt-replicas 1`` on nodes a and b, node c waiting as a spare. The job saves step 1
(plain ``dcp.save`` and stalwart's, whose shard sets the launchers replicate to the
other node); once node a holds rank 1's set, node b is lost and the spare takes rank 1,
fetching its shard set from node a's replica while its worker starts. The restarted
ranks then load the step ``--repeats`` times each way, in one run, the page cache
dropped before each: ``dcp.load`` from disk, ``load_newest`` and plain ``dcp.load``
with ``DcpReader`` (rank 1's shards from the fetched replica).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from netns import Host, Network, free_port, netns_usable, rdzv_args  # noqa: E402

JOB = HERE / "dcp_peer_job.py"
METHODS = ("dcp.load", "load_newest peer replica", "DcpReader peer replica")
CONF = (
    "keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=3,"
    "join_timeout=120,close_timeout=5"
)
#: Bound on each wait for the job (three hosts, 1.1 GiB saved twice on a loaded host).
WAIT_S = 420.0


def _events(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return []


def _launcher_events(work: Path, name: str) -> list[dict]:
    return [e for f in (work / f"logs-{name}").glob("*/events.jsonl") for e in _events(f)]


def _wait(cond: Callable[[], bool], what: str, procs: dict[str, subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        for name, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"node {name}'s launcher exited ({p.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} after {WAIT_S:.0f} s")
        time.sleep(0.1)


def _replica_step(folder: Path, rank: int) -> tuple[int, str] | None:
    from stalwart.launch.replicas import node as rp

    return rp.newest_replica(folder, rank)


def _run(ns: argparse.Namespace, work: Path, net: Network) -> tuple[str, str]:
    from stalwart.checkpoint import ramlayout as rl

    a, b, c = net.add_host(), net.add_host(), net.add_host()
    endpoint = f"{a.addr}:{free_port()}"
    ckpt = work / "ckpt"
    ckpt.mkdir()

    def start(host: Host, name: str) -> subprocess.Popen[str]:
        return host.stalwart(
            *rdzv_args(backend="c10d", endpoint=endpoint, nnodes="1:2", run_id="bench",
                       conf=CONF, max_restarts=3),
            # The loads are measured here, not hang detection (see the restore section).
            "--shutdown-timeout", "3", "--hb-timeout", "600",
            # Two slots of one rank's share (half of model + AdamW) and its metadata.
            "--ckpt-ram", f"{3 * ns.mib // 2 + 128}MiB", "--ckpt-replicas", "1",
            "--log-dir", work / f"logs-{name}",
            JOB, work, ckpt, str(ns.mib), str(ns.repeats),
            log=work / f"{name}.out",
        )  # fmt: skip

    before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    procs = {"a": start(a, "a"), "b": start(b, "b")}
    _wait(lambda: (work / "paused").exists(), "rank 1 holding step 1 in RAM", procs)
    reserved = next(e for e in _launcher_events(work, "a") if e.get("event") == "ckpt_ram_reserved")
    folder = Path(str(reserved["folder"]))
    _wait(
        lambda: _replica_step(folder, 1) == (1, rl.KIND_DCP),
        "node a's replica of rank 1's step 1",
        procs,
    )
    procs["c"] = start(c, "c")
    _wait(
        lambda: "waiting as a spare" in (work / "c.out").read_text(),
        "node c waiting as a spare",
        procs,
    )
    pb = procs.pop("b")
    os.killpg(pb.pid, signal.SIGKILL)
    b.kill_all()
    for name in ("a", "c"):
        rc = procs[name].wait(WAIT_S)
        if rc != 0:
            tail = (work / f"{name}.out").read_text()[-1500:]
            raise RuntimeError(f"node {name}'s launcher exited {rc}:\n{tail}")
    after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return before, after


def peer_section(ns: argparse.Namespace, work: Path) -> int:
    """Restore from a peer's replica vs dcp.load from disk, in one run on simulated hosts."""
    why = netns_usable()
    if why:
        print(f"bench_dcp: peer section skipped: {why}", file=sys.stderr)
        return 1
    net = Network(str(os.getpid() % 10000))
    try:
        before, after = _run(ns, work, net)
    except (RuntimeError, subprocess.TimeoutExpired, StopIteration) as exc:
        print(f"bench_dcp: peer section failed: {exc}", file=sys.stderr)
        return 1
    finally:
        net.close()
    recs = _events(work / "events.jsonl")
    loads = [r for r in recs if r.get("kind") == "load"]
    if not loads:
        print("bench_dcp: peer section failed: no loads", file=sys.stderr)
        return 1
    size = next((r["total_bytes"] for r in recs if r.get("kind") == "size"), 0)
    restored = [
        e
        for name in ("a", "c")
        for e in _launcher_events(work, name)
        if e.get("event") == "checkpoint_restored"
    ]
    # The restarted rank 1 runs on the spare, which holds none of its own shards.
    rank1 = [e for e in restored if e.get("rank") == 1]
    from_replica = [
        e
        for e in rank1
        if e.get("source") == "ram"
        and all(Path(p).name.startswith("replica_") for p in str(e.get("path", "")).split(","))
    ]
    fetched = [e for e in _launcher_events(work, "c") if e.get("event") == "replica_fetched"]
    med = statistics.median
    print(
        f"\n### Restore from a peer replica: FSDP2 on simulated hosts, one rank per node, "
        f"{size / 2**30:.2f} GiB of state, node b lost, the spare takes rank 1, "
        f"{ns.repeats} loads each way, page cache dropped (drop_caches) before each, medians\n"
    )
    print(f"- load before: `{before}`")
    print(f"- load after: `{after}`")
    print(
        f"- restores the launchers logged: {len(restored)}, by source: "
        f"ram {sum(e.get('source') == 'ram' for e in restored)}, "
        f"disk {sum(e.get('source') == 'disk' for e in restored)}; "
        f"rank 1's from the replica the spare fetched: {len(from_replica)} of {len(rank1)}"
    )
    for e in fetched:
        print(
            f"- the spare fetched rank {e['rank']}'s step {e['step']} from node "
            f"{e['from_node']}: {int(e['bytes']) / 2**20:.0f} MiB in {float(e['seconds']):.2f} s "
            "(while its worker started)"
        )
    print()
    base = med([r["took"] for r in loads if r["method"] == "dcp.load"])
    print("| restore | s (min / median / max) | ÷ dcp.load | every load equal to the save |")
    print("|---|---|---|---|")
    for method in METHODS:
        rows = [r for r in loads if r["method"] == method]
        xs = [r["took"] for r in rows]
        if not xs:
            print(f"| {method} | - | - | - |")
            continue
        print(
            f"| {method} | {min(xs):.3f} / {med(xs):.3f} / {max(xs):.3f} | "
            f"{med(xs) / base:.2f} | {all(r['ok'] for r in rows)} |"
        )
    return 0
