"""Checkpoint reliability: a writer or trainer SIGKILLed at any moment of a save never
costs a complete step.

Kill points are chosen two ways: by file-system operation (a forked writer counts
its own mkdir/open/rename/unlink/rmtree audit events and SIGKILLs itself right
before the N-th, so every step of the commit protocol is hit) and by time (the
parent SIGKILLs it after a random delay). After each kill the checkpoint folder
must hold at least as many verifying steps as before, the newest loads and
verifies, and it holds either the old or the new state of the step being saved.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.checkpoint import CheckpointCorruptError, load_latest, verify_step
from stalwart.checkpoint.loader import complete_steps
from stalwart.checkpoint.writer import TorchFileWriter

pytestmark = pytest.mark.reliability

# Events raised before the file-system changes a save makes (see the audit table in
# the Python docs); an "open" covers files created for writing and reads alike.
_FS_EVENTS = frozenset(
    {"os.mkdir", "open", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "os.symlink"}
)
_MIB = 0.5


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(int(_MIB * (1 << 20) / 4), generator=g), "seed": seed}


def _writer_child(root: Path, keep_last: int, step: int, seed: int, kill_at: int | None) -> int:
    """Fork a writer that saves ``_state(seed)`` as ``step``; return its pid.

    With ``kill_at`` the child SIGKILLs itself just before its ``kill_at``-th
    file-system event (counted from the writer's construction, which sweeps what an
    earlier killed writer left). Its exit status is 0 for a save that finished, and
    the number of events it saw is written to ``root/../events``.
    """
    state = _state(seed)
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        count = 0

        def hook(event: str, _args: tuple[Any, ...]) -> None:
            nonlocal count
            if event in _FS_EVENTS:
                count += 1
                if count == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

        sys.addaudithook(hook)
        writer = TorchFileWriter(str(root), 0, 1, keep_last, "crc32")
        writer.write(state, str(root / f"step_{step:09d}"), release=lambda: None, step=step)
        writer.housekeeping()
        (root.parent / "events").write_text(str(count))
        code = 0
    finally:
        os._exit(code)


def _wait(pid: int, deadline_s: float = 60.0) -> int:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"writer {pid} did not finish within {deadline_s} s")


def _verifying(root: Path) -> list[int]:
    good = []
    for step in complete_steps(root):
        try:
            verify_step(root, step, rank=0)
        except CheckpointCorruptError:
            continue
        good.append(step)
    return good


def _loaded_seed(root: Path) -> tuple[int, int]:
    found = load_latest(root, rank=0)
    assert found is not None, "no loadable checkpoint left"
    seed = int(found.state_dict["seed"])
    assert torch.equal(found.state_dict["w"], _state(seed)["w"]), "content does not match"
    verify_step(root, found.step, rank=0)
    return found.step, seed


@pytest.mark.timeout(90)
@pytest.mark.parametrize("keep_last", [1, 2])
def test_resave_killed_at_any_point_never_loses_a_complete_step(
    tmp_path: Path, keep_last: int
) -> None:
    root = tmp_path / "ckpt"
    rng = random.Random(20261123 + keep_last)
    step = 7
    for s, seed in ((step - 1, 1), (step, 2)):
        assert _wait(_writer_child(root, keep_last, s, seed, None)) == 0
    # A clean re-save first: it must take the new state. Its events are the range
    # the kill points are drawn from.
    t0 = time.monotonic()
    assert _wait(_writer_child(root, keep_last, step, 3, None)) == 0
    write_s = time.monotonic() - t0
    events = int((tmp_path / "events").read_text())
    assert events >= 5, events
    assert _loaded_seed(root) == (step, 3)
    current = 3
    # Every event index once, then random ones and random times: >= 30 kills.
    points: list[tuple[str, float]] = [("event", i) for i in range(1, events + 1)]
    while len(points) < max(30, events + 12):
        if rng.random() < 0.5:
            points.append(("event", rng.randint(1, events)))
        else:
            points.append(("time", rng.uniform(0.0, 1.2 * write_s)))
    rng.shuffle(points)
    outcomes = {"killed": 0, "finished": 0}
    for trial, (kind, where) in enumerate(points, start=4):
        before = _verifying(root)
        pid = _writer_child(root, keep_last, step, trial, int(where) if kind == "event" else None)
        if kind == "time":
            time.sleep(where)
            os.kill(pid, signal.SIGKILL)
        status = _wait(pid)
        killed = os.WIFSIGNALED(status)
        outcomes["killed" if killed else "finished"] += 1
        after = _verifying(root)
        assert len(after) >= len(before), (trial, kind, where, before, after)
        found_step, seed = _loaded_seed(root)
        assert found_step == step, (trial, kind, where, found_step)
        # The re-saved step holds the state before this save or the new one, never a mix.
        assert seed in (current, trial), (trial, kind, where, seed, current)
        if not killed:
            assert seed == trial
        current = seed
        latest = int(os.readlink(root / "latest").split("_")[1])
        verify_step(root, latest, rank=0)
    print(f"keep_last={keep_last}: {len(points)} kill points over {events} fs events: {outcomes}")
    assert outcomes["killed"] >= 30 // 2, outcomes
    # The next writer sweeps what the killed ones left: temp folders and data files
    # that no manifest names.
    assert _wait(_writer_child(root, keep_last, step, 999, None)) == 0
    assert not list(root.glob(".tmp-*"))
    names = sorted(p.name for p in (root / f"step_{step:09d}").iterdir())
    assert [n for n in names if n.endswith(".pt")] == ["rank_0.pt"], names
    assert _loaded_seed(root) == (step, 999)


_TRAINER = textwrap.dedent(
    """
    import sys, torch
    from stalwart.checkpoint import AsyncCheckpointer, load_latest

    def state(i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {"w": torch.randn(%(numel)d, generator=g), "i": i}

    def main() -> None:
        root = sys.argv[1]
        found = load_latest(root, rank=0)
        first = 0 if found is None else int(found.state_dict["i"]) + 1
        with AsyncCheckpointer(root, keep_last=2, rank=0, world_size=1) as ckpt:
            for i in range(first, first + 1000):
                # Steps 5, 5, 6, 6, ...: every other save is a re-save.
                ckpt.save(state(i), step=5 + i // 2).result()
                print("saved", i, flush=True)

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.timeout(150)
def test_trainer_or_writer_killed_during_saves_and_resaves(tmp_path: Path) -> None:
    """A real training process (AsyncCheckpointer + its writer child) that resumes from
    load_latest, killed at random moments: its writer child, then the trainer itself,
    then the writer again. Every save it reported done survives; what loads verifies."""
    root = tmp_path / "ckpt"
    script = tmp_path / "trainer.py"
    numel = int(_MIB * (1 << 20) / 4)
    script.write_text(_TRAINER % {"numel": numel})
    rng = random.Random(4242)
    for trial, victim in enumerate(("writer", "trainer", "writer"), start=1):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout is not None
        line, writers = "", []
        try:
            for _ in range(rng.randint(1, 3)):
                line = proc.stdout.readline()
                assert line.startswith("saved"), (trial, line)
            time.sleep(rng.uniform(0.0, 0.05))
            writers = _children(proc.pid)
            if victim == "writer" and writers:
                os.kill(writers[0], signal.SIGKILL)
        finally:
            proc.kill()
            rest = proc.stdout.read()
            proc.wait(timeout=30)
            _wait_gone(writers)
        printed = [
            int(ln.split()[1]) for ln in (line + rest).splitlines() if ln.startswith("saved")
        ]
        found = load_latest(root, rank=0)
        assert found is not None, trial
        i = int(found.state_dict["i"])
        g = torch.Generator().manual_seed(i)
        assert torch.equal(found.state_dict["w"], torch.randn(numel, generator=g))
        verify_step(root, found.step, rank=0)
        assert found.step == 5 + i // 2
        # Never older than the last save reported done; at most the one in flight.
        assert printed[-1] <= i <= printed[-1] + 1, (trial, printed, i)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


def _wait_gone(pids: list[int], deadline_s: float = 20.0) -> None:
    # An orphaned writer finishes its save, then sees the pipe closed and exits.
    end = time.monotonic() + deadline_s
    for pid in pids:
        while True:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                break
            if state == "Z":  # exited; its new parent reaps it
                break
            if time.monotonic() > end:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"writer {pid} outlived its trainer by {deadline_s} s")
            time.sleep(0.02)


@pytest.mark.timeout(60)
def test_load_during_back_to_back_resaves_finds_the_step(tmp_path: Path) -> None:
    """A loader racing a writer that re-saves the only step (keep_last=1) over and
    over always loads that step, with a state that is one whole version."""
    root = tmp_path / "ckpt"
    assert _wait(_writer_child(root, 1, 7, 1, None)) == 0
    stop = tmp_path / "stop"
    # Built before the fork: the child runs no torch kernels of its own.
    states = [_state(seed) for seed in (2, 3, 4)]
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            writer = TorchFileWriter(str(root), 0, 1, 1, "crc32")
            n = 0
            while not stop.exists():
                state = states[n % len(states)]
                writer.write(state, str(root / "step_000000007"), release=lambda: None, step=7)
                n += 1
            code = 0
        finally:
            os._exit(code)
    loads, seeds = 0, set()
    try:
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            found = load_latest(root, rank=0)
            assert found is not None and found.step == 7, "the only step was not found"
            seed = int(found.state_dict["seed"])
            assert torch.equal(found.state_dict["w"], _state(seed)["w"]), "a torn version"
            loads += 1
            seeds.add(seed)
    finally:
        stop.touch()
        status = _wait(pid)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    print(f"{loads} loads during re-saves saw {len(seeds)} versions")
    assert len(seeds) > 1, "the writer never re-saved while the loader ran"
