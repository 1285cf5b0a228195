"""DCP shard files written by stalwart's writer subprocess from shared memory: plain DCP
reads them, the writer killed mid-save leaves nothing loadable and the previous step
intact, and what the rank hands the writer (or reads back from it) is checked."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from stalwart.checkpoint import dcp as sdcp
from stalwart.checkpoint.dcp_shards import (
    ShardFileWriter,
    WrittenFile,
    file_layout,
    write_results,
)
from stalwart.checkpoint.dcp_storage import DcpWriteError
from stalwart.checkpoint.errors import WriterDiedError
from stalwart.checkpoint.manifest import FileEntry
from stalwart.checkpoint.process import CopyStats
from tests.helpers import ROOT, clean_env, free_port, wait_for

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


class Position:
    """A data loader's position: DCP saves it as a byte item (Stateful)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at, "seen": list(range(self.at))}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.at = sd["at"]


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(64, 1024, generator=g)
    return {
        "w": big,
        "half": big[16:48],  # a narrowed view of a larger tensor: only its rows are saved
        "ints": torch.arange(seed, seed + 100, dtype=torch.int64),
        "bf": torch.randn(33, generator=g).to(torch.bfloat16),
        "pos": Position(seed),
        "n": seed,
    }


def blank() -> dict[str, Any]:
    return {
        "w": torch.zeros(64, 1024),
        "half": torch.zeros(32, 1024),
        "ints": torch.zeros(100, dtype=torch.int64),
        "bf": torch.zeros(33, dtype=torch.bfloat16),
        "pos": Position(-1),
        "n": -1,
    }


def equal(got: dict[str, Any], seed: int) -> bool:
    want = state(seed)
    return (
        all(torch.equal(got[k], want[k]) for k in ("w", "half", "ints", "bf"))
        and got["pos"].at == seed
        and got["n"] == seed
    )


_PLAIN_LOAD = """
import sys, torch, torch.distributed.checkpoint as dcp
target = {"w": torch.zeros(64, 1024), "half": torch.zeros(32, 1024)}
dcp.load(target, checkpoint_id=sys.argv[1])
torch.save(target, sys.argv[2])
print("stalwart" in " ".join(sys.modules))
"""

# A script with no __main__ guard that saves through the writer subprocess: its body
# must run once, in the rank only.
_NO_GUARD = """
import sys, torch
from stalwart.checkpoint import dcp as sdcp
with open(sys.argv[2], "a") as f:
    f.write("ran\\n")
saver = sdcp.AsyncDcpSaver(sys.argv[1], keep_last=2)
saver.save({"w": torch.arange(1000.0)}, 4)[1].result(timeout=100)
saver.close()
"""


# A gloo group still alive when the interpreter finalizes is torn down there, and a gloo
# thread that then needs the GIL aborts the process ("terminate called without an active
# exception", exit -6). No __main__ guard; prints how many threads a saver's
# construction started and how many of them are still alive.
_AT_EXIT = """
import atexit, os, sys
import torch, torch.distributed as dist
from stalwart.checkpoint import dcp as sdcp

def tasks():
    return set(os.listdir("/proc/self/task"))

with open(sys.argv[2], "a") as f:
    f.write("ran\\n")
dist.init_process_group("gloo")
before = tasks()
closed = sdcp.AsyncDcpSaver(sys.argv[1] + "/closed", subprocess=False)
made = tasks() - before  # the threads of the group the saver made (its stager starts lazily)
closed.save({"w": torch.arange(10.0)}, 1)[1].result(timeout=200)
closed.close()
print("after close", len(made), len(made & tasks()), flush=True)
before = tasks()
# Registered before the next saver's own handler, so atexit runs it after that one.
atexit.register(lambda: print("at exit", len(made), len(made & tasks()), flush=True))
left = sdcp.AsyncDcpSaver(sys.argv[1] + "/left", subprocess=False)
made = tasks() - before
left.save({"w": torch.arange(20.0)}, 2)  # still in flight when the script ends; never closed
"""


def _in_staging_memfd(t: torch.Tensor) -> bool:
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "memfd:stalwart-ckpt-staging" in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= start and end <= hi:
                return True
    return False


def test_shards_from_the_subprocess_are_plain_dcp_and_stay_private(tmp_path: Path) -> None:
    saver = sdcp.AsyncDcpSaver(tmp_path, keep_last=2)
    try:
        assert saver.shard_process is not None
        saver.shard_process.wait_ready(timeout=100)
        writer_pid = saver.shard_process.pid
        assert writer_pid is not None and writer_pid != os.getpid()
        for step in (1, 2):
            saver.save(state(step), step)[1].result(timeout=100)
        # A stranger on this host finds no port of the writer's to reach and no
        # shared-memory file to read: the buffer is an anonymous memfd, the pipe a
        # socketpair.
        writer = psutil.Process(writer_pid)
        # The DCP writer runs at the rank's own priority (see DCP_WRITER_NICE).
        assert writer.nice() == os.nice(0)
        assert writer.net_connections(kind="inet") == []
        maps = [m.path for m in writer.memory_maps(grouped=True)]
        assert any("memfd:stalwart-ckpt-staging" in p for p in maps), maps
        assert not [p for p in maps if p.startswith("/dev/shm")]
        assert saver.shard_process.pid == writer_pid  # one writer for every save
        assert saver.shard_process.writes == 2
        # One copy per tensor: the stager's buffers are the writer's shared memory, and
        # the upload copies none of them again.
        staged = [b for b in saver.stager._buffers.values() if b.numel()]
        assert staged and all(_in_staging_memfd(b) for b in staged)
        tensor_bytes = sum(b.numel() * b.element_size() for b in staged)
        assert saver.shard_process.copy_stats == CopyStats(0, 2 * tensor_bytes)
        own = [
            line for line in Path("/proc/self/maps").read_text().splitlines() if "/dev/shm" in line
        ]
        assert own == []
    finally:
        saver.close()
    folder = tmp_path / "step_000000002"
    sdcp.verify_share(folder, 0, 1)
    target = blank()
    assert sdcp.load_newest(target, tmp_path) == 2 and equal(target, 2)
    # A program that never imports stalwart reads it with plain dcp.load.
    out = tmp_path / "plain.pt"
    done = subprocess.run(
        [sys.executable, "-c", _PLAIN_LOAD, str(folder), str(out)],
        capture_output=True,
        text=True,
        timeout=100,
        env=clean_env(),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
    got = torch.load(out)
    assert torch.equal(got["w"], state(2)["w"]) and torch.equal(got["half"], state(2)["half"])


def test_a_script_without_main_guard_runs_once(tmp_path: Path) -> None:
    script, marker = tmp_path / "train.py", tmp_path / "ran"
    script.write_text(_NO_GUARD)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), str(marker)],
        capture_output=True,
        text=True,
        timeout=110,
        env=clean_env(),
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert marker.read_text() == "ran\n"
    target = {"w": torch.zeros(1000)}
    dcp.load(target, checkpoint_id=tmp_path / "ckpt" / "step_000000004")
    assert torch.equal(target["w"], torch.arange(1000.0))


def test_writer_killed_mid_save_fails_that_step_only(tmp_path: Path) -> None:
    saver = sdcp.AsyncDcpSaver(tmp_path, keep_last=3)
    try:
        assert saver.shard_process is not None
        saver.shard_process.wait_ready(timeout=100)
        saver.save(state(1), 1)[1].result(timeout=100)
        pid = saver.shard_process.pid
        assert pid is not None
        # Stopped, the writer cannot finish before it is killed: the save is in
        # flight (its folder made, the request sent) when SIGKILL lands.
        os.kill(pid, signal.SIGSTOP)
        _, done = saver.save(state(2), 2)
        wait_for(lambda: (tmp_path / "step_000000002").exists(), 60, "step 2 started")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(DcpWriteError) as err:
            done.result(timeout=100)
        message = str(err.value)
        assert isinstance(err.value.__cause__, WriterDiedError)
        assert "step 2" in message and "died" in message and "\n" not in message
        assert "previous checkpoint is untouched" in message
        assert not (tmp_path / "step_000000002").exists()  # nothing half-written stays
        target = blank()
        assert sdcp.load_newest(target, tmp_path) == 1 and equal(target, 1)
        # The next save gets a new writer.
        saver.save(state(3), 3)[1].result(timeout=100)
        assert saver.shard_process.pid not in (None, pid)
        assert saver.shard_process.writes == 2  # steps 1 and 3
    finally:
        saver.close()
    target = blank()
    assert sdcp.load_newest(target, tmp_path) == 3 and equal(target, 3)


def _item(fqn: str, kind: WriteItemType) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=kind)


def test_file_layout_matches_dcp_naming_and_order() -> None:
    items = [_item("a", WriteItemType.BYTE_IO), _item("b", WriteItemType.BYTE_IO)]
    assert [(n, [i.index.fqn for i in b]) for n, b in file_layout("__3_", items, 1)] == [
        ("__3_0.distcp", ["a", "b"])
    ]
    two = file_layout("__0_", items, 2)
    assert [n for n, _ in two] == ["__0_0.distcp", "__0_1.distcp"]
    with pytest.raises(ValueError, match="files=0"):
        file_layout("__0_", items, 0)


@pytest.mark.parametrize(
    "reported",
    [
        [],  # the file is missing from the answer
        [WrittenFile("__0_0.distcp", ((0, 4),), FileEntry(4, "x", "xxh3-64"))],  # too few
        [WrittenFile("__0_9.distcp", ((0, 4), (4, 4)), FileEntry(8, "x", "xxh3-64"))],
    ],
)
def test_a_writer_answer_that_does_not_match_the_layout_is_refused(
    reported: list[WrittenFile],
) -> None:
    layout = [
        ("__0_0.distcp", [_item("a", WriteItemType.BYTE_IO), _item("b", WriteItemType.BYTE_IO)])
    ]
    with pytest.raises(RuntimeError, match="expected 2"):
        write_results(layout, reported)


@pytest.mark.parametrize("name", ["../evil.distcp", "/etc/x", "", "..", "a/b", 7])
def test_the_writer_refuses_file_names_outside_the_folder(tmp_path: Path, name: Any) -> None:
    writer = ShardFileWriter()
    with pytest.raises(ValueError, match="expected a plain file name"):
        writer.write({"files": [(name, [b"x"])]}, str(tmp_path / "d"), release=lambda: None)
    assert not (tmp_path / "evil.distcp").exists()


def test_the_writer_reports_offsets_and_checksums_of_what_it_wrote(tmp_path: Path) -> None:
    released: list[bool] = []
    t = torch.arange(10.0)
    (w,) = ShardFileWriter().write(
        {"files": [("__0_0.distcp", [b"abc", t])]},
        str(tmp_path),
        release=lambda: released.append(True),
    )
    data = (tmp_path / "__0_0.distcp").read_bytes()
    assert released == [True]
    assert w.extents[0] == (0, 3) and data[:3] == b"abc"
    off, length = w.extents[1]
    assert off == 3 and off + length == len(data) == w.entry.size
    assert torch.equal(torch.load(io.BytesIO(data[off : off + length])), t)
    # No zip CRC32 per record (the file's own checksum covers those bytes), and the
    # process's torch.save setting is left as it was.
    with zipfile.ZipFile(io.BytesIO(data[off : off + length])) as z:
        assert [i.CRC for i in z.infolist()] == [0] * len(z.infolist())
    assert torch.serialization.get_crc32_options()
    from stalwart.checkpoint.manifest import file_checksum

    assert file_checksum(tmp_path / "__0_0.distcp", w.entry.algorithm) == (
        w.entry.size,
        w.entry.checksum,
    )


@pytest.mark.timeout(300)
def test_a_saver_leaves_no_process_group_alive_into_interpreter_teardown(tmp_path: Path) -> None:
    script, marker = tmp_path / "train.py", tmp_path / "ran"
    script.write_text(_AT_EXIT)
    env = clean_env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(marker)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # close() destroyed the saver's own group and let go of it: its threads are joined
    # now, not in the interpreter's teardown; a saver never closed is closed at exit,
    # after its save in flight committed.
    (after_close, at_exit) = (line.split() for line in done.stdout.splitlines()[:2])
    # The group's threads: at least gloo's worker threads, none left.
    assert after_close[:2] == ["after", "close"] and int(after_close[2]) >= 2, done.stdout
    assert after_close[3] == "0", done.stdout
    assert at_exit[:2] == ["at", "exit"] and int(at_exit[2]) >= 2 and at_exit[3] == "0", done.stdout
    assert marker.read_text() == "ran\n"
    assert (tmp_path / "left" / "step_000000002" / "stalwart.commit.json").is_file()
    target = {"w": torch.zeros(20)}
    dcp.load(target, checkpoint_id=tmp_path / "left" / "step_000000002")
    assert torch.equal(target["w"], torch.arange(20.0))
