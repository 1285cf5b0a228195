"""Per-call cost of hang-detection calls and hang-to-detection latency, side by side.

    .venv/bin/python bench/bench_monitor.py [--repeats 5] [--quick]

Columns: stalwart's shared-memory client, torch elastic's FileTimerClient (with its
FileTimerServer running), NVIDIA nvidia-resiliency-ext's RankMonitorClient (with its
RankMonitorServer running; skipped when the package is missing). Every figure is the
median over repeats of the mean per-call time of one batch, in microseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import show

from stalwart.monitor import MonitorConfig, NodeMonitor, RankMonitorClient
from stalwart.monitor.timer import TimerClient


def per_call_us(fn: Callable[[int], None], n: int, repeats: int, pause: float = 0.0) -> list[float]:
    """fn(n) runs n calls; returns one mean per repeat, in µs per call."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(n)
        out.append((time.perf_counter() - t0) / n * 1e6)
        if pause:
            time.sleep(pause)
    return out


@contextlib.contextmanager
def env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bench_stalwart(tmp: Path, repeats: int, scale: int) -> dict[str, list[float]]:
    mon = NodeMonitor(tmp / "stalwart", MonitorConfig(hb_timeout=600), 1, lambda e, f: None)
    mon.start()
    try:
        with env(mon.worker_env(0, 0)):
            client = RankMonitorClient(install_stack_dump=False)
            client.init_workload_monitoring()
            timer = TimerClient(str(mon.pipe_path))

            def hb(n: int) -> None:
                send = client.send_heartbeat
                for _ in range(n):
                    send()

            def section(n: int) -> None:
                start, end = client.start_section, client.end_section
                for _ in range(n):
                    start("step")
                    end("step")

            def timer_pair(n: int) -> None:
                for _ in range(n):
                    timer.acquire("step", time.time() + 600)
                    timer.release("step")

            section(10)
            res = {
                "heartbeat": per_call_us(hb, 200_000 // scale, repeats),
                "section open+close": per_call_us(section, 100_000 // scale, repeats),
                # Batches as small as torch's so its pipe never fills; see the burst row.
                "timer acquire+release": per_call_us(timer_pair, 200, repeats, pause=0.2),
                "timer burst 5000 pairs": per_call_us(timer_pair, 5000, 1),
            }
            client.shutdown_workload_monitoring()
            timer.close()
    finally:
        mon.stop()
    return res


def bench_torch(tmp: Path, repeats: int) -> dict[str, list[float]]:
    from torch.distributed.elastic.timer.file_based_local_timer import (
        FileTimerClient,
        FileTimerServer,
    )

    path = str(tmp / "torch.pipe")
    server = FileTimerServer(path, "bench", max_interval=0.1, daemon=True)
    server.start()
    try:
        client = FileTimerClient(path)

        def pair(n: int) -> None:
            for _ in range(n):
                client.acquire("step", time.time() + 600)
                client.release("step")

        res = {"timer acquire+release": per_call_us(pair, 200, repeats, pause=0.2)}
        try:
            pair(5000)
            res["timer burst 5000 pairs"] = [float("nan")]
        except BlockingIOError:
            res["timer burst 5000 pairs"] = [float("inf")]  # torch raised: pipe full
        return res
    finally:
        server.stop()


def bench_nvidia(tmp: Path, repeats: int, scale: int) -> dict[str, list[float]] | str:
    try:
        from nvidia_resiliency_ext.fault_tolerance import (
            FaultToleranceConfig,
            RankMonitorServer,
        )
        from nvidia_resiliency_ext.fault_tolerance import (
            RankMonitorClient as NvClient,
        )
    except Exception as exc:  # not installed, or it failed to import
        return f"skipped: {exc}"
    logging.getLogger("nvidia_resiliency_ext").setLevel(logging.ERROR)
    sock = str(tmp / "nv.sock")
    cfg = FaultToleranceConfig(rank_section_timeouts={"step": 600.0}, rank_heartbeat_timeout=600.0)
    proc = RankMonitorServer.run_in_subprocess(cfg, sock)
    try:
        with env({"FT_RANK_MONITOR_IPC_SOCKET": sock, "RANK": "0", "LOCAL_RANK": "0"}):
            client = NvClient()
            client.init_workload_monitoring()

            def hb(n: int) -> None:
                for _ in range(n):
                    client.send_heartbeat()

            def section(n: int) -> None:
                for _ in range(n):
                    client.start_section("step")
                    client.end_section("step")

            res = {
                "heartbeat": per_call_us(hb, 2000 // scale, repeats),
                "section open+close": per_call_us(section, 1000 // scale, repeats),
            }
            client.shutdown_workload_monitoring()
        return res
    finally:
        proc.terminate()
        proc.join(5)


HUNG_WORKER = """
import sys, time
from stalwart.monitor import RankMonitorClient
c = RankMonitorClient()
c.init_workload_monitoring()
for _ in range(5):
    c.send_heartbeat(); time.sleep(0.01)
c.send_heartbeat()
print(time.monotonic(), flush=True)
time.sleep(600)
"""


def bench_detection(tmp: Path, repeats: int, timeout: float = 2.0) -> dict[str, list[float]]:
    detected, reported, stacks = [], [], []
    mon = NodeMonitor(tmp / "detect", MonitorConfig(hb_timeout=timeout), 1, lambda e, f: None)
    mon.start()
    try:
        for attempt in range(repeats):
            child_env = dict(os.environ, **mon.worker_env(0, 0))
            err_path = tmp / f"detect{attempt}.err"
            with open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-c", HUNG_WORKER],
                    env=child_env,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
            mon.begin_attempt(attempt, {0: proc.pid}, stderr_paths={0: err_path})
            assert proc.stdout is not None
            last_hb = float(proc.stdout.readline())
            while not (hangs := mon.poll_hangs()):
                time.sleep(0.005)
            reported.append(time.monotonic() - last_hb)
            detected.append(hangs[0].last_heartbeat_age or float("nan"))
            stacks.append(1.0 if "<string>" in hangs[0].stacks else 0.0)
            proc.wait(10)
            mon.end_attempt()
    finally:
        mon.stop()
    return {
        "detected (s after last heartbeat)": detected,
        "reported, stacks included (s)": reported,
        "stacks captured (fraction)": stacks,
    }


def fmt(values: list[float] | None) -> str:
    if not values:
        return "—"
    med = statistics.median(values)
    if med == float("inf"):
        return "BlockingIOError"
    if med != med:
        return "ok"
    return f"{med:.2f}" if med < 100 else f"{med:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer calls per batch")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables")
    args = ap.parse_args()
    scale = 10 if args.quick else 1
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ours = bench_stalwart(tmp, args.repeats, scale)
        theirs = bench_torch(tmp, args.repeats)
        nvidia = bench_nvidia(tmp, args.repeats, scale)
        detection = bench_detection(tmp, args.repeats)

    nv = nvidia if isinstance(nvidia, dict) else {}
    rows = [
        [row, fmt(ours.get(row)), fmt(theirs.get(row)), fmt(nv.get(row))]
        for row in (
            "heartbeat",
            "section open+close",
            "timer acquire+release",
            "timer burst 5000 pairs",
        )
    ]
    show(
        f"Per-call cost, µs (median of {args.repeats})",
        ["call", "stalwart", "torch FileTimer", "NVIDIA RankMonitorClient"],
        rows,
        args.markdown,
    )
    if isinstance(nvidia, str):
        print(f"NVIDIA column {nvidia}")
    show(
        f"Hang → detection, heartbeat timeout 2 s, check interval 0.1 s ({args.repeats} runs), s",
        ["measure", "min", "median", "max"],
        [
            [name, f"{min(v):.3f}", f"{statistics.median(v):.3f}", f"{max(v):.3f}"]
            for name, v in detection.items()
        ],
        args.markdown,
    )
    print("Goal: heartbeat ≤ 1 µs, section open+close ≤ 2 µs, detection ≤ timeout + 0.2 s.")


if __name__ == "__main__":
    main()
