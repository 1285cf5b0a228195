"""Node loss → first resumed step, from a peer's RAM replica vs from disk.

Simulated hosts (network namespaces): a 2-node gloo DDP job (``--nnodes 1:2``, one rank
per node, ``bench/ram_train.py``) snapshots model + optimizer + ``--state-mb``
MiB of per-rank data every 5th step (0.5 s apart) into ``--ckpt-ram`` and persists every
10th snapshot to disk; a third host waits as a spare. Node b is lost (its launcher's process group
SIGKILLed, then everything on the host); the spare takes rank 1. Timed: from the kill to
the moment both ranks finished their first step of the new attempt, how many steps the
job had to redo, and when it was back at the step it had reached before the loss.

* ``replica``: ``--ckpt-replicas 1`` (the default): the spare copies rank 1's newest
  snapshot from node a's replica and both ranks resume from RAM;
* ``disk``: ``--ckpt-replicas 0``: rank 1 has nothing in RAM, so both ranks resume from
  the newest step on disk (files written seconds before: in the page cache; the
  container cannot drop it).

``--fetch-only``: just the copy a spare makes, in one process on 127.0.0.1 (a
``ReplicaServer`` holding a snapshot, a ``ReplicaHolder`` with a reserved segment
fetching it), no root needed.

Needs root.  ``python bench/bench_replicas.py [--repeats 3] [--state-mb 64] [--markdown]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from common import fmt, machine, med, show, spread  # noqa: E402
from netns import Host, Network, free_port, netns_usable, rdzv_args  # noqa: E402

JOB = ROOT / "bench" / "ram_train.py"
CONF = "keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=3,join_timeout=60"
STEP_S = 0.1
SAVE_EVERY = 5
PERSIST_EVERY = 10
KILL_AT = 75  # step 49 (the 10th snapshot) is on disk by then, step 74 in RAM


def _launch(
    host: Host, work: Path, endpoint: str, name: str, mode: str, state_mb: int
) -> subprocess.Popen[str]:
    return host.stalwart(
        *rdzv_args(
            backend="c10d",
            endpoint=endpoint,
            nnodes="1:2",
            run_id="bench",
            conf=CONF,
            max_restarts=3,
        ),
        "--shutdown-timeout",
        "3",
        "--ckpt-ram",
        f"{state_mb + 8}MiB",
        "--ckpt-replicas",
        "1" if mode == "replica" else "0",
        "--log-dir",
        work / f"logs-{name}",
        JOB,
        "100000",
        work,
        "--step-s",
        str(STEP_S),
        "--save-every",
        str(SAVE_EVERY),
        "--persist-every",
        str(PERSIST_EVERY),
        "--state-mb",
        str(state_mb),
        log=work / f"{name}.out",
    )


def _progress(work: Path) -> tuple[int, int] | None:
    try:
        att, step = (work / "progress").read_text().split()
        return int(att), int(step)
    except (FileNotFoundError, ValueError):
        return None


def _rows(path: Path) -> list[dict[str, object]]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def _events(folder: Path) -> list[dict[str, object]]:
    return [
        json.loads(x) for f in folder.glob("*/events.jsonl") for x in f.read_text().splitlines()
    ]


def _wait(cond: object, what: str, procs: list[subprocess.Popen[str]], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            print(f"  {what}: gave up", flush=True)
            return False
        time.sleep(0.01)
    return True


def once(mode: str, a: Host, b: Host, c: Host, work: Path, state_mb: int) -> dict[str, float]:
    work.mkdir(parents=True)
    endpoint = f"{a.addr}:{free_port()}"
    pa = _launch(a, work, endpoint, "a", mode, state_mb)
    pb = _launch(b, work, endpoint, "b", mode, state_mb)
    try:
        if not _wait(lambda: (_progress(work) or (0, -1))[1] >= 3, "start", [pa, pb], 120):
            return {}
        pc = _launch(c, work, endpoint, "c", mode, state_mb)
        t_spare = time.monotonic()
        spare = lambda: "waiting as a spare" in (work / "c.out").read_text()  # noqa: E731
        if not _wait(spare, "spare", [pa, pb, pc], 60):
            return {}
        # A spare has usually waited long enough for its warm template (torch imported)
        # to be ready; one that joined seconds before the loss would start its worker
        # cold, and that, not the replica, would be timed. Its readiness shows in no
        # event before its first spawn, so give it half as long again as a's and b's
        # templates took to import on this machine a moment ago.
        imports = [
            float(str(e["import_s"]))
            for e in _events(work / "logs-a") + _events(work / "logs-b")
            if e["event"] == "template_ready" and e.get("import_s") is not None
        ]
        settle = 1.5 * max(imports, default=0.0)
        if not _wait(lambda: time.monotonic() - t_spare >= settle, "spare", [pa, pb, pc], 120):
            return {}
        # The kill comes at the same place between two disk steps in every run (the
        # spare's wait may have taken the job past KILL_AT).
        period = SAVE_EVERY * PERSIST_EVERY
        now = (_progress(work) or (0, 0))[1]
        kill_at = KILL_AT + max(0, -(-(now - KILL_AT) // period)) * period
        if not _wait(lambda: (_progress(work) or (0, -1))[1] >= kill_at, "steps", [pa, pc], 120):
            return {}
        # Which step each rank had committed is unknown to the bench: count redone steps
        # from the newest step any rank reported, read just before the kill.
        got = _progress(work)
        assert got is not None
        t_kill = time.time()
        os.killpg(pb.pid, signal.SIGKILL)
        b.kill_all()

        def resumed() -> bool:
            return len([r for r in _rows(work / "first_steps.jsonl") if r["attempt"] != 0]) >= 2

        if not _wait(resumed, "resume", [pa, pc], 120):
            return {}

        def caught_up() -> bool:
            now = _progress(work)
            return now is not None and now[0] != got[0] and now[1] >= got[1]

        # Where the job was when the node went: the work lost is redone by then.
        if not _wait(caught_up, "catch up", [pa, pc], 120):
            return {}
        t_back = time.time()
        firsts = [r for r in _rows(work / "first_steps.jsonl") if r["attempt"] != 0]
        later = [r for r in _rows(work / "attempts.jsonl") if r["attempt"] != 0]
        sources = {str(r["source"]) for r in later}
        start = min(int(str(r["start"])) for r in later)
        out = {
            "resumed_s": max(float(str(r["t"])) for r in firsts) - t_kill,
            "back_s": t_back - t_kill,
            "redone": float(got[1] + 1 - start),
            "from_ram": float(sources == {"ram"}),
        }
        ev_a = _events(work / "logs-a")
        ev_c = _events(work / "logs-c")
        lost = [e for e in ev_a if e["event"] == "node_lost"]
        if lost:
            out["detect_s"] = float(lost[0]["time"]) - t_kill
        joined = [e for e in ev_c if e["event"] == "rendezvous_done" and e["attempt"] != 0]
        if joined:
            out["rendezvous_s"] = float(joined[0]["time"]) - t_kill
        fetched = [e for e in ev_c if e["event"] == "replica_fetched"]
        if fetched:
            out["fetch_s"] = float(fetched[0]["seconds"])
        spawned = [e for e in ev_c if e["event"] == "worker_spawn" and e["attempt"] != 0]
        if spawned:
            out["spawn_s"] = float(spawned[0]["time"]) - t_kill
        # Inside the workers: started (imports done), restored, per rank of the new attempt.
        for r in later:
            who = "spare" if int(str(r["rank"])) == 1 else "survivor"
            out[f"{who}_started_s"] = float(str(r["process_start"])) - t_kill
            out[f"{who}_restored_s"] = float(str(r["restored_at"])) - t_kill
        print(
            f"  {mode}: resumed {out['resumed_s']:.2f} s after the kill, from {sources}, "
            f"{int(out['redone'])} steps redone"
            + (f", fetch {out['fetch_s']:.2f} s" if "fetch_s" in out else ""),
            flush=True,
        )
        return out
    finally:
        for h in (a, b, c):
            h.stop()


def fetch_only(state_mb: int, repeats: int) -> list[float]:
    """Seconds ``fetch_missing`` takes to copy one rank's snapshot of ``state_mb`` MiB."""
    import torch

    from stalwart.checkpoint import ramlayout as rl
    from stalwart.checkpoint.ram import RamSegment
    from stalwart.checkpoint.staging import plan
    from stalwart.launch.replicas import node as rp
    from stalwart.launch.replicas.snapshots import SnapshotMemory

    def quiet(*_: object, **__: object) -> None:
        return None

    src = SnapshotMemory(1, (state_mb + 8) << 20)
    dst = SnapshotMemory(1, (state_mb + 8) << 20)
    took = []
    try:
        seg = RamSegment.open(src.folder / rl.segment_name(0))
        seg.write(plan({"blob": torch.randn(state_mb << 18)}), 5, 1, 2)
        seg.close()
        key = rp.job_key(b"bench-replicas-secret-0123456789", "bench")
        srv = rp.ReplicaServer(
            rp.ReplicaHolder(src.folder, src.slot_bytes, quiet),
            "127.0.0.1",
            lambda: 0,
            key,
            lambda _round, _node: None,
        )
        try:
            for _ in range(repeats):
                for p in dst.folder.glob(f"{rp.REPLICA_PREFIX}*"):
                    p.unlink()
                holder = rp.ReplicaHolder(dst.folder, dst.slot_bytes, quiet, reserve=1)
                time.sleep(0.5)  # as at a launcher's start: the reserved pages are faulted in
                t0 = time.perf_counter()
                peers = {0: srv.address(0, 0, 0, 1, 2)}
                (got,) = rp.fetch_missing(holder, [1], 2, peers, quiet, key, 1)
                took.append(time.perf_counter() - t0)
                assert got.step == 5, got
                holder.close()
        finally:
            srv.close()
    finally:
        src.close()
        dst.close()
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--state-mb", type=int, default=64)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the work folders (logs)")
    ap.add_argument("--fetch-only", action="store_true", help="time the spare's copy alone")
    ns = ap.parse_args()
    if ns.fetch_only:
        took = fetch_only(ns.state_mb, max(ns.repeats, 5))
        print(f"fetch of {ns.state_mb} MiB on 127.0.0.1 (min / median / max): {spread(took)}")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = netns_usable()
    if why:
        print(f"bench_replicas: skipped: {why}", file=sys.stderr)
        return 0
    print(f"machine: {machine()}")
    print(
        f"- 2 nodes + 1 spare, 1 rank per node, {ns.state_mb} MiB of extra state per rank, "
        f"steps of {STEP_S} s, a snapshot every {SAVE_EVERY} steps, every {PERSIST_EVERY}th "
        f"snapshot to disk; node b lost at step {KILL_AT}; rdzv-conf `{CONF}`"
    )
    results: dict[str, list[dict[str, float]]] = {"replica": [], "disk": []}
    root = Path(tempfile.mkdtemp(prefix="stalwart-rep-"))
    net = Network(f"{os.getpid() % 10000}")
    try:
        a, b, c = net.add_host(), net.add_host(), net.add_host()
        for rep in range(ns.repeats):
            for mode in ("replica", "disk"):
                print(f"[{rep + 1}/{ns.repeats}] {mode}", flush=True)
                got = once(mode, a, b, c, root / f"{mode}{rep}", ns.state_mb)
                if got:
                    results[mode].append(got)
    finally:
        net.close()
        if ns.keep:
            print(f"work folders kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    rows = []
    for mode, runs in results.items():

        def col(key: str, runs: list[dict[str, float]] = runs) -> list[float]:
            return [r[key] for r in runs if key in r]

        rows.append(
            [
                "peer replica (RAM)" if mode == "replica" else "disk",
                spread(col("resumed_s")),
                fmt(med(col("detect_s"))),
                fmt(med(col("rendezvous_s"))),
                fmt(med(col("fetch_s"))),
                fmt(med(col("spawn_s"))),
                fmt(med(col("survivor_started_s"))),
                fmt(med(col("spare_started_s"))),
                fmt(med(col("survivor_restored_s"))),
                fmt(med(col("spare_restored_s"))),
                fmt(med(col("redone")), "", 0),
                spread(col("back_s")),
                f"{int(sum(col('from_ram')))}/{len(runs)}",
            ]
        )
    show(
        f"Node loss → both ranks' first resumed step ({ns.state_mb} MiB per rank; "
        f"min / median / max of {ns.repeats} where three figures, else medians; "
        "times from the kill, except the fetch's own duration)",
        [
            "restore from",
            "kill → first resumed step",
            "survivor sees the loss",
            "spare in the new round",
            "spare's fetch",
            "spare's worker spawned",
            "survivor's worker running",
            "spare's worker running",
            "survivor restored",
            "spare restored",
            "steps redone",
            "kill → back at the step reached before it",
            "all ranks from RAM",
        ],
        rows,
        ns.markdown,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
