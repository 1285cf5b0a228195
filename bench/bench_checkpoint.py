"""Checkpoint benchmark: caller stall, time to durable, bandwidth, compute slowdown.

Runs, side by side and round-robin (so disk noise hits every method alike):
torch.save (plain and + fsync), a plain fsync'd write of the same bytes (the
disk's limit), torch.distributed.checkpoint.async_save (default and with its
asynchronous stager), and stalwart's AsyncCheckpointer (sync staging with and
without ``reserve_for`` at setup, and background staging). For the asynchronous methods a 1-thread matmul loop runs while the
save is in flight and its step time is compared with an idle baseline.

    .venv/bin/python bench/bench_checkpoint.py [--size-mib 1024] [--repeats 5] [--markdown]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from rich.console import Console
from rich.table import Table

from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig, StagingMode

StateDict = dict[str, torch.Tensor]


@dataclass
class Sample:
    stall_s: float
    total_s: float
    slowdown: float | None = None
    # CPU seconds the save itself used (all its threads and processes, the
    # compute loop excluded): unlike wall time, barely affected by other load.
    cpu_s: float | None = None


@dataclass
class Result:
    name: str
    samples: list[Sample] = field(default_factory=list)
    first: Sample | None = None
    note: str = ""

    def median(self, attr: str) -> float | None:
        vals = [getattr(s, attr) for s in self.samples if getattr(s, attr) is not None]
        return statistics.median(vals) if vals else None


class ComputeLoop:
    """A 1-thread matmul loop standing in for the training step."""

    def __init__(self) -> None:
        self.a = torch.randn(192, 192)
        self.b = torch.randn(192, 192)
        self.baseline_s = 0.0

    def step(self) -> float:
        t0 = time.perf_counter()
        for _ in range(8):
            torch.mm(self.a, self.b, out=self.a)
            self.a.clamp_(-1.0, 1.0)
        return time.perf_counter() - t0

    def calibrate(self, seconds: float = 1.0) -> None:
        times = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            times.append(self.step())
        self.baseline_s = statistics.mean(times)

    def run_until(self, done: threading.Event) -> float:
        """Steps until ``done``; returns the mean step time relative to baseline, minus 1."""
        times: list[float] = []
        while not done.is_set():
            times.append(self.step())
        if len(times) < 3:
            return float("nan")
        return statistics.mean(times) / self.baseline_s - 1.0


def make_state(size_mib: int) -> StateDict:
    # 8 equal float32 tensors, like the layers of a model.
    per = size_mib * (1 << 20) // 8 // 4
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(8)}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _own_cpu() -> float:
    t = psutil.Process().cpu_times()
    return float(t.user + t.system)


def _pid_cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system)


def _sync_sample(fn: Callable[[], None]) -> Sample:
    cpu0 = _own_cpu()
    t0 = time.perf_counter()
    fn()
    t = time.perf_counter() - t0
    return Sample(t, t, cpu_s=_own_cpu() - cpu0)


def _async_sample(
    start: Callable[[], tuple[Future[Any], Any]],
    loop: ComputeLoop,
    *,
    measure_loop: bool,
    helper_pid: Callable[[], int | None] = lambda: None,
) -> Sample:
    done = threading.Event()
    finished_at: list[float] = []

    def mark(_: Future[Any]) -> None:
        finished_at.append(time.perf_counter())
        done.set()

    if measure_loop:
        # Re-measure the idle step right before each save: the machine is shared
        # and its speed drifts, so a stale baseline would bias the slowdown.
        loop.calibrate(0.4)
    pid = helper_pid()
    cpu0, helper0 = _own_cpu(), _pid_cpu(pid)
    t0 = time.perf_counter()
    fut, keep = start()
    stall = time.perf_counter() - t0
    fut.add_done_callback(mark)
    loop0 = time.thread_time()
    slowdown = loop.run_until(done) if measure_loop else None
    loop_cpu = time.thread_time() - loop0
    done.wait()
    fut.result()
    cpu = _own_cpu() - cpu0 - loop_cpu + (_pid_cpu(pid) - helper0 if pid == helper_pid() else 0.0)
    del keep
    return Sample(stall, finished_at[0] - t0, slowdown, cpu)


class Bench:
    def __init__(self, size_mib: int, root: Path) -> None:
        self.size_mib = size_mib
        self.nbytes = size_mib << 20
        self.root = root
        self.state = make_state(size_mib)
        self.loop = ComputeLoop()
        self.ckpt_sync: AsyncCheckpointer | None = None
        self.ckpt_reserved: AsyncCheckpointer | None = None
        self.ckpt_bg: AsyncCheckpointer | None = None
        self.dcp_stager: Any = None

    def fresh(self, name: str) -> Path:
        path = self.root / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    # -- synchronous baselines ---------------------------------------------

    def torch_save(self, fsync: bool) -> Sample:
        out = self.fresh("torch_save") / "ckpt.pt"

        def run() -> None:
            torch.save(self.state, out)
            if fsync:
                _fsync(out)

        return _sync_sample(run)

    def plain_write(self) -> Sample:
        out = self.fresh("dd") / "blob"

        def run() -> None:
            with open(out, "wb", buffering=0) as f:
                for tensor in self.state.values():
                    f.write(_tensor_bytes(tensor))
                os.fsync(f.fileno())

        return _sync_sample(run)

    # -- torch.distributed.checkpoint --------------------------------------

    def dcp(self, stager: bool) -> Sample:
        from torch.distributed.checkpoint.state_dict_saver import async_save

        out = self.fresh("dcp_stager" if stager else "dcp")

        def start() -> tuple[Future[Any], Any]:
            kwargs: dict[str, Any] = {"checkpoint_id": str(out), "no_dist": True}
            if stager:
                kwargs["async_stager"] = self.dcp_stager
            resp: Any = async_save(self.state, **kwargs)
            fut: Future[Any] = getattr(resp, "upload_completion", resp)
            return fut, resp

        return _async_sample(start, self.loop, measure_loop=True)

    # -- stalwart -----------------------------------------------------------

    def stalwart(self, ckpt: AsyncCheckpointer, step: int) -> Sample:
        def start() -> tuple[Future[Any], Any]:
            return ckpt.save(self.state, step=step), None

        return _async_sample(
            start, self.loop, measure_loop=True, helper_pid=lambda: ckpt.writer_pid
        )


def _make_dcp_stager() -> tuple[Any, str]:
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None, "torch has no DefaultStager"
    # Pinned memory and non-blocking copies need CUDA; async staging runs on CPU.
    cuda = torch.cuda.is_available()
    opts = StagingOptions(cuda, False, True, cuda)
    return DefaultStager(opts), ""


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "—" if v is None or v != v else format(v, spec)


def _pct(v: float | None) -> str:
    return "—" if v is None or v != v else f"{v * 100:+.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir in /tmp)")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    parser.add_argument("--skip-dcp", action="store_true")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated substrings: run only methods whose name contains one "
        "(the torch.save and plain-write references always run)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    console = Console()

    root = Path(args.dir or tempfile.mkdtemp(prefix="stalwart-bench-", dir="/tmp"))
    bench = Bench(args.size_mib, root)
    header = (
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M UTC} · {platform.node()} · "
        f"{os.cpu_count()} CPUs · torch {torch.__version__} · python {platform.python_version()}"
        f" · {args.size_mib} MiB state (8 float32 tensors) → {root} · {args.repeats} repeats"
    )
    console.print(header)

    results: dict[str, Result] = {}

    def add(name: str) -> Result:
        results[name] = Result(name)
        return results[name]

    add("torch.save")
    add("torch.save + fsync")
    add("plain write + fsync (disk limit)")
    if not args.skip_dcp:
        add("dcp.async_save (default)")
        bench.dcp_stager, why = _make_dcp_stager()
        if bench.dcp_stager is not None:
            add("dcp.async_save (async stager)")
        else:
            console.print(f"[yellow]skipping DCP async stager: {why}")
    add("stalwart (sync staging)")
    add("stalwart (sync staging, reserve_for at setup)")
    add("stalwart (background staging)")

    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    if wanted:
        always = {"torch.save", "plain write + fsync (disk limit)"}
        for name in list(results):
            if name not in always and not any(w in name for w in wanted):
                del results[name]

    # Writers start now: construction spawns and warms the child, like a
    # training script that builds its checkpointer before its first step.
    t0 = time.perf_counter()
    bench.ckpt_sync = AsyncCheckpointer(root / "stalwart_sync", keep_last=1, rank=0, world_size=1)
    bench.ckpt_reserved = AsyncCheckpointer(
        root / "stalwart_reserved", keep_last=1, rank=0, world_size=1
    )
    bench.ckpt_bg = AsyncCheckpointer(
        root / "stalwart_bg",
        keep_last=1,
        rank=0,
        world_size=1,
        config=CheckpointerConfig(staging=StagingMode.BACKGROUND),
    )
    construct_s = time.perf_counter() - t0
    # What a training script does once its model and optimizer exist (with an
    # optimizer, auto_reserve does the same after its first step): size the
    # staging buffer off the training thread. Untimed, like construction; a
    # script's first steps overlap it.
    t0 = time.perf_counter()
    reserved = bench.ckpt_reserved.reserve_for(bench.state)
    reserve_call_s = time.perf_counter() - t0
    bench.loop.calibrate(2.0)  # the children finish starting meanwhile
    reserved.result()
    console.print(
        f"compute loop baseline: {bench.loop.baseline_s * 1e3:.2f} ms/step; "
        f"AsyncCheckpointer construction: {construct_s * 1e3:.1f} ms for three; "
        f"reserve_for returned in {reserve_call_s * 1e3:.1f} ms"
    )

    step = 0
    runners: dict[str, Callable[[], Sample]] = {
        "torch.save": lambda: bench.torch_save(False),
        "torch.save + fsync": lambda: bench.torch_save(True),
        "plain write + fsync (disk limit)": bench.plain_write,
        "dcp.async_save (default)": lambda: bench.dcp(False),
        "dcp.async_save (async stager)": lambda: bench.dcp(True),
        "stalwart (sync staging)": lambda: bench.stalwart(bench.ckpt_sync, step),  # type: ignore[arg-type]
        "stalwart (sync staging, reserve_for at setup)": lambda: bench.stalwart(
            bench.ckpt_reserved,  # type: ignore[arg-type]
            step,
        ),
        "stalwart (background staging)": lambda: bench.stalwart(bench.ckpt_bg, step),  # type: ignore[arg-type]
    }
    # One untimed-for-the-median first round: it is reported as "first save".
    for rep in range(args.repeats + 1):
        step += 1
        for name, res in results.items():
            sample = runners[name]()
            # Untimed: flush what a method left dirty (plain torch.save does not
            # fsync) so it is not charged to the next method in the round.
            os.sync()
            if rep == 0:
                res.first = sample
            else:
                res.samples.append(sample)
        console.print(f"round {rep}/{args.repeats} done", style="dim")

    bench.ckpt_sync.close()
    bench.ckpt_reserved.close()
    bench.ckpt_bg.close()
    if bench.dcp_stager is not None:
        bench.dcp_stager.close()

    ref_save = results["torch.save"].median("stall_s")
    ref_disk = results["plain write + fsync (disk limit)"].median("total_s")
    table = Table(title=f"Checkpointing {args.size_mib} MiB — medians of {args.repeats}")
    cols = [
        "method",
        "stall s",
        "stall ÷ torch.save",
        "durable s",
        "durable ÷ plain write",
        "MiB/s",
        "loop slowdown",
        "CPU s",
        "first-save stall s",
    ]
    for c in cols:
        table.add_column(c, justify="left" if c == "method" else "right")
    rows: list[list[str]] = []
    for res in results.values():
        stall = res.median("stall_s")
        total = res.median("total_s")
        row = [
            res.name,
            _fmt(stall),
            _fmt(stall / ref_save if stall is not None and ref_save else None, ".3f"),
            _fmt(total),
            _fmt(total / ref_disk if total is not None and ref_disk else None, ".2f"),
            _fmt(args.size_mib / total if total else None, ".0f"),
            _pct(res.median("slowdown")),
            _fmt(res.median("cpu_s"), ".2f"),
            _fmt(res.first.stall_s if res.first else None),
        ]
        rows.append(row)
        table.add_row(*row)
    console.print(table)

    stager = results.get("dcp.async_save (async stager)")
    checks = []
    for res in [r for n, r in results.items() if n.startswith("stalwart")]:
        stall, total, slow = res.median("stall_s"), res.median("total_s"), res.median("slowdown")
        line = (
            f"{res.name}: stall ÷ torch.save = {_fmt((stall or 0) / (ref_save or 1))} (goal ≤ 0.05)"
        )
        if stager is not None:
            line += f"; stall vs DCP async stager {_fmt(stall)} vs {_fmt(stager.median('stall_s'))}"
        line += (
            f"; durable ÷ plain write = {_fmt((total or 0) / (ref_disk or 1), '.2f')} (goal ≤ 1.3)"
        )
        line += f"; loop slowdown {_pct(slow)} (goal ≤ 5%)"
        first = res.first.stall_s if res.first else None
        line += f"; first-save stall {_fmt(first)} s vs median {_fmt(stall)} s"
        checks.append(line)
    for line in checks:
        console.print(line)

    if args.markdown:
        print()
        print(header)
        print()
        print("| " + " | ".join(cols) + " |")
        print("|" + "|".join("---" for _ in cols) + "|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print()
        for line in checks:
            print(f"- {line}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
