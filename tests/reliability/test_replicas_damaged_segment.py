"""A damaged RAM snapshot segment is a corrupt checkpoint, not the end of the job.

One node, two ranks, ``--ckpt-ram``: once a step is complete on disk and RAM is ahead of
it, rank 1's segment file is cut to half its size (a stray ``truncate``, a full
``/dev/shm``) and rank 1's worker is killed. Its segment can no longer be mapped; the
restarted ranks skip it with one warning, agree on the newest step on disk, and finish
with the model a one-process run computes. Before, the snapshot scan let the mapping's
``ValueError`` through and the job failed after every restart.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import psutil
import pytest
import torch

from stalwart.checkpoint import complete_steps
from stalwart.checkpoint import ramlayout as rl
from stalwart.checkpoint.ram import RamSegment, find_snapshots
from stalwart.checkpoint.staging import plan
from stalwart.launch.replicas import node as rp
from stalwart.launch.replicas.snapshots import SnapshotMemory
from tests.helpers import read_events, wait_for
from tests.multinode.replica_helpers import (
    SLOT,
    Events,
    addr,
    push,
    ram_job,
    replica_steps,
    server,
    snapshot,
    start_job,
)
from tests.multinode.test_netns import assert_matches_reference, wait_for_step

pytestmark = pytest.mark.timeout(240)

STEPS = 40


def _worker_of(launcher: int, local_rank: int) -> psutil.Process | None:
    """The running worker of ``local_rank`` among the launcher's descendants."""
    try:
        procs = psutil.Process(launcher).children(recursive=True)
    except psutil.Error:
        return None
    for p in procs:
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("LOCAL_RANK") == str(local_rank) and "ram_train.py" in " ".join(p.cmdline()):
            return p
    return None


def test_half_truncated_segment_falls_back_to_disk(tmp_path: Path) -> None:
    proc = start_job(
        tmp_path / "job.out",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        *ram_job(tmp_path / "logs", tmp_path, STEPS, 0.1, persist_every=5),
    )
    try:
        wait_for_step(tmp_path, 12, [proc])
        wait_for(lambda: 9 in complete_steps(tmp_path / "ckpt", 2), 60, "step 9 on disk")
        (ev_file,) = (tmp_path / "logs").glob("*/events.jsonl")
        (reserved,) = [e for e in read_events(ev_file) if e["event"] == "ckpt_ram_reserved"]
        segment = Path(reserved["folder"]) / rl.segment_name(1)
        size = segment.stat().st_size
        os.truncate(segment, size // 2)
        worker = _worker_of(proc.pid, 1)
        if worker is not None:  # it may have died of the truncation already (SIGBUS)
            worker.send_signal(signal.SIGKILL)
        assert proc.wait(180) == 0, (tmp_path / "job.out").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert_matches_reference(tmp_path, STEPS)
    rows = [json.loads(x) for x in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    resumed = [r for r in rows if r["attempt"] != 0]
    assert sorted(r["rank"] for r in resumed[-2:]) == [0, 1], rows
    # Both ranks agreed on one step; rank 1 had no usable snapshot, so it is on disk.
    (start,) = {r["start"] for r in resumed[-2:]}
    assert {r["source"] for r in resumed[-2:]} == {"disk"}, rows
    assert start - 1 == resumed[-1]["newest_disk"], rows
    evs = read_events(ev_file)
    repaired = [e for e in evs if e["event"] == "ckpt_ram_repaired"]
    assert [e["segment"] for e in repaired] == [rl.segment_name(1)], repaired


@pytest.mark.parametrize("cut", [0.5, 0.25, 0.0])
def test_a_cut_segment_is_skipped_with_one_warning_and_disk_loads(
    tmp_path: Path, cut: float, caplog: pytest.LogCaptureFixture
) -> None:
    mem = SnapshotMemory(1, 1 << 20, base=tmp_path)
    try:
        seg = RamSegment.open(mem.folder / rl.segment_name(0))
        seg.write(plan({"w": torch.full((1000,), 7.0)}), 7, 0, 1)
        seg.close()
        path = mem.folder / rl.segment_name(0)
        left = int(path.stat().st_size * cut)
        os.truncate(path, left)
        with caplog.at_level(logging.WARNING, logger="stalwart.checkpoint.ram"):
            assert find_snapshots(mem.folder, 0, 1) == []
        lines = [r for r in caplog.records if "skipping snapshot segment" in r.getMessage()]
        assert len(lines) == 1, caplog.text
        assert "\n" not in lines[0].getMessage()
        # The launcher makes it anew between rounds: whole, empty, mappable.
        assert mem.repair() == [(path.name, f"{left} bytes, {mem.segment_bytes} expected")]
        assert path.stat().st_size == mem.segment_bytes
        seg = RamSegment.open(path)
        assert seg.records() == []
        seg.close()
    finally:
        mem.close()


def test_a_replica_segment_cut_under_the_launcher_is_made_anew(tmp_path: Path) -> None:
    """The launcher keeps replica segments mapped; one cut short under it is made anew
    at the next push rather than written past its end (a SIGBUS would end the launcher)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = (
        SnapshotMemory(1, SLOT, base=tmp_path / "a"),
        SnapshotMemory(1, SLOT, base=tmp_path / "b"),
    )
    srv = server(b, Events(), 1)
    try:
        for step in (3, 5):
            snapshot(a, 0, rank=2, step=step)
            seg = rp.SegmentFile(a.folder / rl.segment_name(0), writable=False)
            (slot, rec), *_ = seg.records()
            assert push(addr(srv), seg, slot, rec, 0) == ""
            seg.close()
            if step == 3:
                replica = b.folder / f"{rp.REPLICA_PREFIX}2{rl.SEGMENT_SUFFIX}"
                os.truncate(replica, replica.stat().st_size // 2)
        assert replica_steps(b.folder, 2) == [5]
    finally:
        srv.close()
        a.close()
        b.close()
