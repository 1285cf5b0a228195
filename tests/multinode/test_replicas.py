"""RAM snapshot replicas across simulated hosts: a node is lost, the spare that takes its
place restores the lost node's ranks from a replica a survivor holds, and every rank
resumes from RAM at a step newer than anything on disk; the same for an FSDP2 job's DCP
shard sets. Then the other side: with the launcher SIGKILLed the snapshots are gone and
the disk checkpoints load as before.

The job is ``bench/ram_train.py`` (``elastic_train.py`` checkpointed with ``AsyncCheckpointer``);
its final model is compared with a one-process reference, so a resume from a wrong or
torn state fails the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from bench.netns import Host, Network, rdzv_args
from stalwart.base.events import Event
from stalwart.checkpoint import complete_steps
from stalwart.checkpoint import ramlayout as rl
from stalwart.launch.replicas import node as rp
from tests.helpers import ROOT, free_port, wait_for
from tests.multinode.replica_helpers import ram_job, start_job

from .test_netns import FAST, assert_matches_reference, events, text, wait_for_step

pytestmark = pytest.mark.timeout(240)

STEPS = 40


def wait_for_disk_step(out: Path, step: int, world: int) -> None:
    wait_for(lambda: step in complete_steps(out / "ckpt", world), 60, f"step {step} on disk", 0.05)


def launch(
    host: Host, out: Path, endpoint: str, name: str, *extra: str, step_s: float = 0.25
) -> subprocess.Popen[str]:
    return host.stalwart(
        *rdzv_args(
            backend="c10d", endpoint=endpoint, nnodes="1:2", run_id="job", conf=FAST, max_restarts=3
        ),
        "--shutdown-timeout",
        "3",
        *extra,
        # A snapshot every 2nd step (0.5 s apart: longer than a replica takes, even on a
        # busy machine), every 10th of them on disk: steps 19 and 39. The restarted job,
        # once the spare has its replica, runs unpaced.
        *ram_job(
            out / f"logs-{name}",
            out,
            STEPS,
            step_s,
            persist_every=10,
            save_every=2,
            later_step_s=0,
        ),
        log=out / f"{name}.out",
    )


def attempts(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]


def lose_node(host: Host, launcher: subprocess.Popen[str]) -> None:
    """The launcher's process group SIGKILLed, then whatever else ran on that host."""
    os.killpg(launcher.pid, signal.SIGKILL)
    host.kill_all()


def test_a_spare_restores_the_lost_nodes_rank_from_a_peer_replica(
    network: Network, tmp_path: Path
) -> None:
    a, b, c = network.add_host(), network.add_host(), network.add_host()
    endpoint = f"{a.addr}:{free_port()}"
    pa = launch(a, tmp_path, endpoint, "a")
    pb = launch(b, tmp_path, endpoint, "b")
    wait_for_step(tmp_path, 3, [pa, pb])
    pc = launch(c, tmp_path, endpoint, "c")

    def spare() -> bool:
        assert pc.poll() is None, text(tmp_path, "c")[-2000:]
        return "waiting as a spare" in text(tmp_path, "c")

    wait_for(spare, 60, "node c to wait as a spare", 0.05)
    # Past the first step on disk (the 10th snapshot, step 19), complete on both ranks,
    # and a few more steps: RAM is then ahead of the disk (the next disk step is 39).
    wait_for_step(tmp_path, 23, [pa, pb, pc])
    wait_for_disk_step(tmp_path, 19, 2)
    lose_node(b, pb)
    assert pa.wait(120) == 0, text(tmp_path, "a")[-3000:]
    assert pc.wait(60) == 0, text(tmp_path, "c")[-3000:]
    assert_matches_reference(tmp_path, STEPS)
    later = [r for r in attempts(tmp_path) if r["attempt"] != 0]
    assert sorted(int(str(r["rank"])) for r in later) == [0, 1], later
    # Both ranks resumed from RAM, at one step, newer than the newest step on disk.
    assert {r["source"] for r in later} == {"ram"}, later
    (start,) = {int(str(r["start"])) for r in later}
    newest_disk = max(int(str(r["newest_disk"])) for r in later)
    assert start - 1 > newest_disk == 19, later
    # The spare brought rank 1's snapshot over from node a's replica before it started.
    fetched = [e for e in events(tmp_path, "c") if e["event"] == rp.REPLICA_FETCHED]
    assert [(e["rank"], e["from_node"]) for e in fetched] == [(1, 0)], fetched
    assert int(str(fetched[0]["step"])) >= start - 1


DCP_WORKER = ROOT / "tests" / "reliability" / "dcp_fsdp_worker.py"


def test_a_spare_restores_the_lost_nodes_fsdp2_shards_from_a_peer_replica(
    network: Network, tmp_path: Path
) -> None:
    """An FSDP2 job, one rank per node, DCP shard sets in RAM: rank 1's node is lost
    after step 2; the spare fetches rank 1's shard set from node 0's replica, and both
    ranks load step 2 from RAM, the gathered state equal to the saved one bit for bit
    (checked in the workers, whose script has no ``__main__`` guard)."""
    a, b, c = network.add_host(), network.add_host(), network.add_host()
    endpoint = f"{a.addr}:{free_port()}"
    root = tmp_path / "ckpt"

    def start(host: Host, name: str) -> subprocess.Popen[str]:
        return host.stalwart(
            *rdzv_args(backend="c10d", endpoint=endpoint, nnodes="1:2", run_id="job",
                       conf=FAST, max_restarts=3),
            # Rank 1 waits to be lost for longer than a learned heartbeat timeout.
            "--shutdown-timeout", "3", "--hb-timeout", "120",
            "--ckpt-ram", "8MiB", "--ckpt-replicas", "1",
            "--log-dir", tmp_path / f"logs-{name}",
            DCP_WORKER, "nodejob", tmp_path, root, "3", "2",
            log=tmp_path / f"{name}.out",
        )  # fmt: skip

    pa, pb = start(a, "a"), start(b, "b")

    def paused() -> bool:
        for name, p in (("a", pa), ("b", pb)):
            assert p.poll() is None, text(tmp_path, name)[-3000:]
        return (tmp_path / "paused").exists()

    wait_for(paused, 120, "rank 1 to hold step 2 in RAM", 0.05)
    pid = (tmp_path / "paused").read_text()
    where = subprocess.run(["ip", "netns", "identify", pid], capture_output=True, text=True)
    assert where.stdout.split() == [b.name], f"rank 1 runs in {where.stdout!r}, not on node b"
    folder = Path(
        str(
            next(e for e in events(tmp_path, "a") if e["event"] == Event.CKPT_RAM_RESERVED)[
                "folder"
            ]
        )
    )
    # Node b's replicator pushed rank 1's shard set of step 2 to node a.
    wait_for(
        lambda: rp.newest_replica(folder, 1) == (2, rl.KIND_DCP),
        30,
        "node a's replica of step 2",
        0.05,
    )
    pc = start(c, "c")

    def spare() -> bool:
        assert pc.poll() is None, text(tmp_path, "c")[-2000:]
        return "waiting as a spare" in text(tmp_path, "c")

    wait_for(spare, 60, "node c to wait as a spare", 0.05)
    lose_node(b, pb)
    assert pa.wait(120) == 0, text(tmp_path, "a")[-3000:]
    assert pc.wait(60) == 0, text(tmp_path, "c")[-3000:]
    # First attempt: nothing to load; second: both ranks at step 2 (4 batches).
    resumes = sorted((tmp_path / "resumes").read_text().splitlines())
    assert resumes == ["0 2 4", "0 None 0", "1 2 4", "1 None 0"], resumes
    restored = sorted(
        (e["rank"], e["step"], e["source"], Path(str(e["path"])).name)
        for name in ("a", "c")
        for e in events(tmp_path, name)
        if e["event"] == Event.CHECKPOINT_RESTORED
    )
    # Rank 0 from its own segment on node a; rank 1, on the spare, from the replica.
    assert restored == [
        (0, 2, "ram", rl.segment_name(0)), (1, 2, "ram", f"{rp.REPLICA_PREFIX}1{rl.SEGMENT_SUFFIX}")
    ], restored  # fmt: skip
    fetched = [e for e in events(tmp_path, "c") if e["event"] == rp.REPLICA_FETCHED]
    assert [(e["rank"], e["from_node"], e["step"]) for e in fetched] == [(1, 0, 2)], fetched
    assert os.readlink(root / "latest") == "step_000000003"
    # The script ran once per rank and attempt: nothing on the save path re-ran it.
    assert len((tmp_path / "starts").read_text().splitlines()) == 4


def test_launcher_sigkilled_snapshots_gone_disk_checkpoint_loads(tmp_path: Path) -> None:
    """One node, 2 ranks: the launcher's group is SIGKILLed mid-run; its snapshot memory
    is freed by the guardian; a new launch of the same job resumes from the newest step
    on disk, as without --ckpt-ram."""

    def run(name: str) -> subprocess.Popen[str]:
        return start_job(
            tmp_path / f"{name}.out",
            "--nproc-per-node",
            "2",
            *ram_job(tmp_path / f"logs-{name}", tmp_path, STEPS, 0.05, persist_every=5),
        )

    first = run("first")
    try:
        wait_for_step(tmp_path, 12, [first])
        wait_for_disk_step(tmp_path, 9, 2)
        (ev_file,) = (tmp_path / "logs-first").glob("*/events.jsonl")
        reserved = [
            e
            for e in map(json.loads, ev_file.read_text().splitlines())
            if e["event"] == "ckpt_ram_reserved"
        ]
        folder = Path(reserved[0]["folder"])
        assert folder.is_dir()
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
        wait_for(lambda: not folder.exists(), 30, f"{folder} to go with its launcher", 0.05)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(30)
    second = run("second")
    try:
        assert second.wait(180) == 0, (tmp_path / "second.out").read_text()[-3000:]
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait(30)
    assert_matches_reference(tmp_path, STEPS)
    resumed = [r for r in attempts(tmp_path) if r["start"] != 0]
    assert len(resumed) == 2, attempts(tmp_path)
    assert {r["source"] for r in resumed} == {"disk"}, resumed
    (start,) = {int(str(r["start"])) for r in resumed}
    assert start - 1 == int(str(resumed[0]["newest_disk"])) >= 9, resumed
