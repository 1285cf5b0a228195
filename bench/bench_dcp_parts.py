"""Where a DCP save through stalwart's writer subprocess spends its time, part by part.

    .venv/bin/python bench/bench_dcp_parts.py [--mib 256] [--repeats 3] [--markdown]

One process, no process group, a state of ``--mib`` MiB of float32 tensors (64 MiB
each, as FSDP2 shards of a large model would be). Each repeat measures, on the same
bytes, interleaved:
  - the parts of the writer's work done apart: the staging copy (one tensor copy),
    ``torch.save`` of each tensor into a sink that drops the bytes (serialization and
    its zip CRC32), hashing (xxh3_64), a buffered write of the raw bytes without and
    with one fsync at the end, the same with ``sync_file_range`` started as written;
  - the shard writer's own ``write`` in this process (serialize + hash + write + fsync);
  - whole saves to durable: ``AsyncDcpSaver`` with the writer subprocess at nice 0 and
    nice +5, and with DCP's thread in the rank, and a plain fsync'd write of the bytes;
  - the same saves while a one-thread matmul loop runs in this process: the loop's
    median step time during the save vs alone (what the writer's niceness is for).
Prints medians with ``uptime`` before and after.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import torch  # noqa: E402

from stalwart.checkpoint import dcp as sdcp  # noqa: E402
from stalwart.checkpoint.dcp_shard_writer import ShardFileWriter  # noqa: E402
from stalwart.checkpoint.manifest import new_hasher  # noqa: E402
from stalwart.checkpoint.process_args import WriterProcessConfig  # noqa: E402
from stalwart.checkpoint.streaming import start_writeback  # noqa: E402

TENSOR_MIB = 64


class _Null(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return len(memoryview(b))


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy())


def _write_file(path: Path, state: dict[str, torch.Tensor], *, fsync: bool, srange: bool) -> None:
    with open(path, "wb", buffering=0) as f:
        at = 0
        for t in state.values():
            n = f.write(_raw(t))
            assert n is not None
            if srange:
                start_writeback(f.fileno(), at, n)
            at += n
        if fsync:
            os.fsync(f.fileno())
    path.unlink()


def _timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


class Loop:
    """A one-thread matmul loop; ``steps(t0, t1)``: its step times inside a window."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._times: list[tuple[float, float]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        a = torch.randn(384, 384)
        while not self._stop.is_set():
            t0 = time.perf_counter()
            for _ in range(8):
                a = torch.tanh(a @ a)
            self._times.append((t0, time.perf_counter()))

    def steps(self, t0: float, t1: float) -> list[float]:
        return [e - s for s, e in list(self._times) if s >= t0 and e <= t1]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", action="store_true")
    ns = ap.parse_args()
    if ns.mib < TENSOR_MIB or ns.repeats < 1:
        print(f"--mib {ns.mib}: expected >= {TENSOR_MIB}; --repeats >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    n = ns.mib // TENSOR_MIB
    elems = TENSOR_MIB * 2**20 // 4
    state = {f"t{i}": torch.randn(elems) for i in range(n)}
    nbytes = n * elems * 4
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-dcp-parts-"))
    savers = {
        f"subprocess nice {nice}": sdcp.AsyncDcpSaver(
            work / f"nice{nice}",
            keep_last=1,
            writer_config=WriterProcessConfig(init_timeout_s=600.0, writer_nice=nice),
        )
        for nice in (0, 5)
    }
    savers["in-rank (DCP thread)"] = sdcp.AsyncDcpSaver(
        work / "thread", keep_last=1, subprocess=False
    )
    for s in savers.values():
        if s.shard_process is not None:
            s.shard_process.wait_ready(600)
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    times: dict[str, list[float]] = {}
    loop_steps: dict[str, list[float]] = {}

    def add(name: str, took: float) -> None:
        times.setdefault(name, []).append(took)

    step = 0
    for rep in range(ns.repeats):
        add(
            "staging copy",
            _timed(lambda: [d.copy_(s) for d, s in zip(dst.values(), state.values(), strict=True)]),
        )

        def save_null() -> None:
            for t in state.values():
                torch.save(t, io.BufferedWriter(_Null(), 1 << 20))

        add("torch.save of each tensor (no disk)", _timed(save_null))

        def hash_all() -> None:
            h = new_hasher("xxh3_64")
            for t in state.values():
                h.update(_raw(t))

        add("xxh3_64 hash", _timed(hash_all))
        raw = work / f"raw-{rep}"
        add("buffered write, no fsync", _timed(_write_file, raw, state, fsync=False, srange=False))
        add(
            "plain write + fsync (baseline)",
            _timed(_write_file, raw, state, fsync=True, srange=False),
        )
        add(
            "write + sync_file_range as written + fsync",
            _timed(_write_file, raw, state, fsync=True, srange=True),
        )
        folder = work / f"shard-{rep}"
        folder.mkdir()
        datas: list[bytes | torch.Tensor] = list(state.values())
        add(
            "shard writer's write in-process",
            _timed(
                ShardFileWriter().write,
                {"files": [("__0_0.distcp", datas)]},
                str(folder),
                release=lambda: None,
            ),
        )
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
        for name, saver in savers.items():
            step += 1
            took = _timed(lambda s=saver, st=step: s.save(state, st)[1].result())  # type: ignore[misc]
            add(f"durable: {name}", took)
        # The same saves with a compute loop running: its step time during each.
        loop = Loop()
        time.sleep(1.0)
        t0 = time.perf_counter()
        time.sleep(2.0)
        loop_steps.setdefault("no save", []).extend(loop.steps(t0, time.perf_counter()))
        for name, saver in savers.items():
            step += 1
            t0 = time.perf_counter()
            saver.save(state, step)[1].result()
            t1 = time.perf_counter()
            add(f"durable with the loop running: {name}", t1 - t0)
            loop_steps.setdefault(name, []).extend(loop.steps(t0, t1))
        loop.stop()
    for s in savers.values():
        s.close()
    after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    plain = statistics.median(times["plain write + fsync (baseline)"])
    print(json.dumps({"mib": ns.mib, "bytes": nbytes, "load_before": before, "load_after": after}))
    if ns.markdown:
        print(f"\n- load before: `{before}`\n- load after: `{after}`\n")
        print("| part | s (min / median / max) | ÷ plain write + fsync |\n|---|---|---|")
        for name, xs in times.items():
            med = statistics.median(xs)
            print(f"| {name} | {min(xs):.3f} / {med:.3f} / {max(xs):.3f} | {med / plain:.2f} |")
        alone = statistics.median(loop_steps["no save"])
        print("\n| loop step during | median ms | ÷ alone | steps |\n|---|---|---|---|")
        for name, xs in loop_steps.items():
            med = statistics.median(xs) if xs else float("nan")
            print(f"| {name} | {med * 1e3:.1f} | {med / alone:.2f} | {len(xs)} |")
    else:
        for name, xs in times.items():
            print(f"{name}: median {statistics.median(xs):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
