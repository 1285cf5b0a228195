"""FSDP2 (``fully_shard``) jobs on gloo saving and loading through stalwart's DCP path:
round trips with optimizer state and data position, interop with plain DCP both ways,
a torn shard, a rank killed during an async save, and resharding 4 -> 2 -> 4."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from stalwart import runlog
from stalwart.checkpoint import ramlayout as rl
from tests.helpers import ROOT, clean_env, free_port, stalwart, wait_for

WORKER = Path(__file__).with_name("dcp_fsdp_worker.py")


@dataclass
class Rank:
    proc: subprocess.Popen[str]
    out: Path
    err: Path

    def output(self) -> tuple[str, str]:
        return self.out.read_text(), self.err.read_text()


def _start(
    n: int, args: list[str | Path], port: int, extra: dict[str, str] | None = None
) -> list[Rank]:
    # Output goes to files: a rank blocked on a full pipe would stall its peers'
    # collectives while the test waits on another rank.
    started = []
    for rank in range(n):
        env = clean_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(n),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONFAULTHANDLER="1",
            **(extra or {}),
        )
        out = Path(args[1]) / f"{args[0]}-{port}-{rank}.stdout"
        err = out.with_suffix(".stderr")
        with open(out, "w") as out_f, open(err, "w") as err_f:
            proc = subprocess.Popen(
                [sys.executable, str(WORKER), *map(str, args)],
                stdout=out_f,
                stderr=err_f,
                text=True,
                env=env,
                cwd=ROOT,
            )
        started.append(Rank(proc, out, err))
    return started


def _stop(started: list[Rank]) -> None:
    for r in started:
        if r.proc.poll() is None:
            r.proc.kill()
        r.proc.wait()


def ranks(
    n: int, *args: str | Path, timeout: float = 240, env: dict[str, str] | None = None
) -> list[str]:
    """Run the worker on ``n`` ranks; every rank's stdout (all must exit 0)."""
    started = _start(n, list(args), free_port(), env)
    try:
        wait_for(lambda: all(r.proc.poll() is not None for r in started), timeout, f"{args[0]}")
    finally:
        _stop(started)
    outs = []
    for rank, r in enumerate(started):
        out, err = r.output()
        assert r.proc.returncode == 0, f"rank {rank} exited {r.proc.returncode}:\n{err[-3000:]}"
        outs.append(out)
    return outs


def loaded(outs: list[str]) -> set[str]:
    return {line for out in outs for line in out.splitlines() if line.startswith("LOADED")}


@pytest.fixture
def job(tmp_path: Path) -> tuple[Path, Path]:
    out, root = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    return out, root


def _starts(out: Path) -> int:
    return len((out / "starts").read_text().splitlines())


@pytest.mark.timeout(600)
def test_round_trip_with_optimizer_and_interop_both_ways(job: tuple[Path, Path]) -> None:
    out, root = job
    ranks(2, "save", out, root, 1, 2, 3)
    # keep_last=2: step 1 is gone, `latest` names step 3, both kept steps are committed.
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000000002", "step_000000003"]
    assert os.readlink(root / "latest") == "step_000000003"
    # A fresh model (other seed) loads it through stalwart: model, AdamW state and the
    # data position equal the saved ones bit for bit; then plain dcp.load, which knows
    # nothing of stalwart, reads the same folder.
    assert loaded(ranks(2, "load", out, root)) == {"LOADED 3"}
    assert loaded(ranks(2, "plainload", out, root, 3)) == {"LOADED 3"}
    # A plain dcp.save (no stalwart writer) of a newer step is found by stalwart's loader.
    ranks(2, "plain", out, root, 5)
    assert not (root / "step_000000005" / "stalwart.commit.json").exists()
    assert loaded(ranks(2, "load", out, root)) == {"LOADED 5"}
    # The script has no __main__ guard and ran once per rank and run: nothing re-ran it.
    assert _starts(out) == 10


@pytest.mark.timeout(600)
def test_async_save_round_trip(job: tuple[Path, Path]) -> None:
    out, root = job
    outs = ranks(2, "async", out, root, 1, 2)
    # Each rank's shards came from its own writer subprocess, not from the rank.
    for o in outs:
        (line,) = [x for x in o.splitlines() if x.startswith("SHARDS WRITTEN BY")]
        writer, rank_pid, saves = line.split()[3], line.split()[5], line.split()[7]
        assert writer.isdigit() and writer != rank_pid and saves == "2", line
    assert (root / "step_000000002" / "stalwart.commit.json").exists()
    assert loaded(ranks(2, "load", out, root)) == {"LOADED 2"}
    assert _starts(out) == 4


@pytest.mark.timeout(600)
def test_torn_shard_every_rank_falls_back_to_the_same_step(job: tuple[Path, Path]) -> None:
    out, root = job
    ranks(2, "save", out, root, 1, 2)
    shard = root / "step_000000002" / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte, same size
    shard.write_bytes(bytes(raw))
    # Rank 1 of the loading job checks __1_0 (its slice), rank 0 does not; both load 1.
    assert loaded(ranks(2, "load", out, root)) == {"LOADED 1"}


@pytest.mark.timeout(600)
def test_missing_shard_and_hostile_metadata_fall_back(job: tuple[Path, Path]) -> None:
    out, root = job
    ranks(2, "save", out, root, 1, 2)
    (root / "step_000000002" / "__0_0.distcp").unlink()
    # A newer plain-looking folder whose .metadata is a pickle that would run code.
    evil = root / "step_000000009"
    evil.mkdir()
    marker = out / "pwned"
    import pickle

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    (evil / ".metadata").write_bytes(pickle.dumps(Evil()))
    assert loaded(ranks(2, "load", out, root)) == {"LOADED 1"}
    assert not marker.exists()


@pytest.mark.timeout(600)
def test_reshard_4_to_2_to_4(job: tuple[Path, Path]) -> None:
    out, root = job
    ranks(4, "save", out, root, 1)
    # 2 ranks load what 4 saved (the gathered state equals the saved one), then save.
    assert loaded(ranks(2, "load", out, root, 2)) == {"LOADED 1"}
    # 4 ranks load what 2 saved.
    assert loaded(ranks(4, "load", out, root)) == {"LOADED 2"}


@pytest.mark.timeout(600)
def test_rank_killed_during_async_saves_never_leaves_a_loadable_torn_step(
    job: tuple[Path, Path],
) -> None:
    out, root = job
    rng = random.Random(23)
    for victim in (1, 0):  # a non-coordinator, then the coordinator that commits
        started = _start(2, ["loop", out, root], free_port())
        try:
            wait_for(lambda: "SAVED" in started[0].output()[0], 240, "a committed save")  # noqa: B023
            # The fault's moment is the point of the trial: somewhere in the next saves.
            time.sleep(rng.uniform(0.0, 0.4))
            os.kill(started[victim].proc.pid, signal.SIGKILL)
        finally:
            _stop(started)
        # Whatever the kill tore, the loader agrees on a committed step that verifies and
        # whose gathered state is the one recorded for it (checked inside the workers).
        (line,) = loaded(ranks(2, "load", out, root))
        step = int(line.split()[1])
        assert (root / f"step_{step:09d}" / "stalwart.commit.json").exists()
        # A step without a commit record is never what `latest` names.
        latest = root / os.readlink(root / "latest")
        assert (latest / "stalwart.commit.json").exists()


@pytest.mark.timeout(600)
def test_async_checkpointer_saves_and_restores_a_dtensor_state(job: tuple[Path, Path]) -> None:
    out, root = job
    # AsyncCheckpointer.save given {"app": Stateful over get_state_dict(...)} of an
    # FSDP2 model goes through DCP; restore(into=...) loads the newest step in place.
    assert loaded(ranks(2, "ckpt", out, root, 1, 2, 3)) == {"LOADED 3"}
    assert (root / "step_000000003" / "stalwart.commit.json").exists()
    assert not (root / "step_000000001").exists()  # keep_last=2
    # What AsyncCheckpointer wrote is a plain DCP checkpoint.
    assert loaded(ranks(2, "plainload", out, root, 3)) == {"LOADED 3"}


@pytest.mark.timeout(600)
def test_fsdp2_job_under_stalwart_run_resumes_after_a_crash(job: tuple[Path, Path]) -> None:
    out, root = job
    res = stalwart(
        "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", out / "logs",
        WORKER, "job", out, root, 5,
        timeout=540,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "crashed").exists()
    # First attempt: nothing to load. Second: both ranks resumed from step 3 (the last
    # step committed before rank 1 died), with the gathered state and the data position
    # (6 batches: 2 per step) equal to what was saved.
    resumes = sorted((out / "resumes").read_text().splitlines())
    assert resumes == ["0 3 6", "0 None 0", "1 3 6", "1 None 0"], resumes
    assert os.readlink(root / "latest") == "step_000000005"


@pytest.mark.timeout(600)
def test_fsdp2_job_under_ckpt_ram_restores_shards_from_ram_else_disk(
    job: tuple[Path, Path],
) -> None:
    out, root = job
    res = stalwart(
        "--nproc-per-node", "2", "--max-restarts", "2", "--ckpt-ram", "8MiB",
        "--log-dir", out / "logs", WORKER, "ramjob", out, root, 6,
        timeout=540,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "tampered_3").exists() and (out / "tampered_5").exists()
    # Second attempt: step 3, whose shards on disk were torn, came whole from RAM (the
    # gathered state equals the saved one bit for bit); third: rank 1's RAM copy of
    # step 5 was damaged, so both ranks loaded step 5 from disk together.
    resumes = sorted((out / "resumes").read_text().splitlines())
    assert resumes == [
        "0 3 6", "0 5 10", "0 None 0", "1 3 6", "1 5 10", "1 None 0"
    ], resumes  # fmt: skip
    restored = sorted(
        (e["attempt"], e["rank"], e["step"], e["source"])
        for e in map(
            json.loads, next((out / "logs").rglob("events.jsonl")).read_text().splitlines()
        )
        if e["event"] == "checkpoint_restored"
    )
    assert restored == [
        (1, 0, 3, "ram"), (1, 1, 3, "ram"), (2, 0, 5, "disk"), (2, 1, 5, "disk")
    ], restored  # fmt: skip
    # The script has no __main__ guard and ran once per rank and attempt.
    assert _starts(out) == 6
    # A restarted (warm) rank verified its newest shard set while the program started,
    # so its restore hashed nothing on its own thread (before: the set it serves, every
    # restore). Rank 1's copy of step 5, changed through a second writable mapping after
    # its commit, failed that check and was hashed again where it was to be served: by
    # rank 1, then, planned again, by rank 0 (same node), and refused both times.
    hashes = sorted((out / "hashes").read_text().splitlines())
    assert hashes == [
        "0 0 0 True", "0 1 0 True", "1 0 0 True", "1 1 0 True", "2 0 1 True", "2 1 1 True"
    ], hashes  # fmt: skip


@pytest.mark.timeout(600)
def test_bigger_worlds_step_with_a_shard_missing_falls_back_whole(job: tuple[Path, Path]) -> None:
    out, root = job
    ranks(4, "save", out, root, 1, 2)
    (root / "step_000000002" / "__3_0.distcp").unlink()  # the lost node's shard
    # 2 ranks: step 2's metadata names a shard that is gone, so every rank loads step 1,
    # whole (the gathered state equals step 1's, checked inside the workers).
    assert loaded(ranks(2, "load", out, root)) == {"LOADED 1"}


def _tear(folder: Path) -> None:
    for shard in folder.glob("__*_*.distcp"):
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))


@pytest.mark.timeout(600)
def test_resized_world_restores_from_the_shard_sets_its_node_holds_in_ram(
    job: tuple[Path, Path],
) -> None:
    out, root = job
    # One node's launcher memory, as `--ckpt-ram` lays it out, shared by the three runs:
    # 2 ranks save, then 1 rank resumes (and saves), then 2 ranks resume again.
    ram = out / "ram"
    ram.mkdir(mode=0o700)
    for local in range(2):
        fd = os.open(ram / rl.segment_name(local), os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, rl.segment_bytes(8 << 20))
        os.close(fd)
    events = out / "events.jsonl"
    events.touch()
    env = {rl.RAM_DIR_ENV: str(ram), runlog.EVENTS_FILE_ENV: str(events)}
    ranks(2, "save", out, root, 2, env=env)
    # Step 2's shards on disk are torn: only RAM holds it whole. One rank loads what two
    # saved, both shard sets read from its node's segments (the gathered state equals
    # the saved one, checked in the worker), then saves step 3 at world size 1.
    _tear(root / "step_000000002")
    assert loaded(ranks(1, "load", out, root, 3, env=env)) == {"LOADED 2"}
    # Two ranks load what one saved: rank 0 serves the shard set, rank 1's share of it
    # comes over the process group.
    _tear(root / "step_000000003")
    assert loaded(ranks(2, "load", out, root, env=env)) == {"LOADED 3"}
    restored = sorted(
        (e["step"], e["source"])
        for e in map(json.loads, events.read_text().splitlines())
        if e["event"] == "checkpoint_restored"
    )
    assert restored == [(2, "ram"), (3, "ram"), (3, "ram")], restored
    assert _starts(out) == 5


PLAIN_JOB = Path(__file__).with_name("dcp_plain_ram_job.py")


def _restored(out: Path) -> list[tuple[int, int, int, str]]:
    return sorted(
        (e["attempt"], e["rank"], e["step"], e["source"])
        for e in map(
            json.loads, next((out / "logs").rglob("events.jsonl")).read_text().splitlines()
        )
        if e["event"] == "checkpoint_restored"
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["writer", "plain"])
def test_a_program_calling_dcp_itself_under_ckpt_ram(job: tuple[Path, Path], mode: str) -> None:
    out, root = job
    res = stalwart(
        "--nproc-per-node", "2", "--max-restarts", "1", "--ckpt-ram", "8MiB",
        "--log-dir", out / "logs", PLAIN_JOB, mode, out, root, 4,
        timeout=540,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "crashed").exists()
    # Both ranks resumed from step 3 with the gathered state equal to the saved one
    # (checked in the job) and the data position (2 batches a step).
    resumes = sorted((out / "resumes").read_text().splitlines())
    assert resumes == ["0 3 6", "0 None 0", "1 3 6", "1 None 0"], resumes
    if mode == "writer":
        # Plain dcp.save(storage_writer=DcpWriter(...)) kept every rank's shards in the
        # launcher's memory; after the crash plain dcp.load(storage_reader=DcpReader(...))
        # read them from there (the files on disk were torn: a disk read fails its
        # checksums), every rank together.
        assert _restored(out) == [(1, 0, 3, "ram"), (1, 1, 3, "ram")]
        assert (root / "step_000000004" / "stalwart.commit.json").exists()
    else:
        # A program that never imports stalwart: plain DCP folders, nothing of ours in
        # them, and no restore of ours reported.
        assert _restored(out) == []
        assert not list(root.rglob("*stalwart*"))
    # No __main__ guard: the script ran once per rank and attempt.
    assert _starts(out) == 4
