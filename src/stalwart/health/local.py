"""What one node measures of itself before a round: compute, memory, disk, interface.

Compute is a rate for the judge to compare with the peers' (never with a constant);
memory, disk and the interface are floors a node either meets or not.
"""

from __future__ import annotations

import ipaddress
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

# Small enough that BLAS keeps it on one thread and one burst holds thousands of them;
# bursts longer than a CFS period (100 ms) so a throttled cgroup shows in each.
_SIDE = 64
BURST_S = 0.12
BURSTS = 3


def _cgroup_dir() -> Path | None:
    """This process's cgroup folder (v2, or v1's cpu controller)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            where = Path("/sys/fs/cgroup") / path.lstrip("/")
        elif "cpu" in controllers.split(","):
            where = Path("/sys/fs/cgroup/cpu") / path.lstrip("/")
        else:
            continue
        if (where / "cpu.stat").exists():
            return where
    return None


def _cpu_stat_path() -> Path | None:
    """The ``cpu.stat`` of this process's cgroup."""
    where = _cgroup_dir()
    return None if where is None else where / "cpu.stat"


def cpu_share(quota: str, period: str) -> float | None:
    """The CPUs a CFS limit allows (``cpu.max``'s two fields, or v1's
    ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``); None: no limit, or nothing
    readable as one."""
    if quota.strip() in ("max", "-1"):
        return None
    try:
        q, t = int(quota), int(period)
    except ValueError:
        return None
    if q <= 0 or t <= 0:
        return None
    try:
        return q / t
    except OverflowError:  # no kernel writes this: not a limit
        return None


def _limit_of(folder: Path) -> float | None:
    try:
        if (folder / "cpu.max").exists():
            quota, _, period = (folder / "cpu.max").read_text().strip().partition(" ")
            return cpu_share(quota, period)
        if (folder / "cpu.cfs_quota_us").exists():
            quota = (folder / "cpu.cfs_quota_us").read_text()
            return cpu_share(quota, (folder / "cpu.cfs_period_us").read_text())
    except OSError:
        pass
    return None


def cpu_limit(folder: Path | None = None) -> float | None:
    """The CPUs this node's cgroup and its parents allow it at most (the tightest
    limit); None: no limit."""
    start = folder if folder is not None else _cgroup_dir()
    if start is None:
        return None
    shares = []
    for where in (start, *start.parents):
        if where in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu"), Path("/")):
            break
        if (share := _limit_of(where)) is not None:
            shares.append(share)
    return min(shares, default=None)


def throttled_periods(stat: Path | None) -> int:
    """How many CPU periods this process's cgroup was held back by its own CPU limit."""
    if stat is None:
        return 0
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "nr_throttled":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def compute_rate(bursts: int = BURSTS, burst_s: float = BURST_S) -> float:
    """Matrix products per second this node can do, in the best of a few bursts.

    A burst in which the node's own cgroup hit its CPU limit counts at the pace it got
    (products per wall second: the limit is the node's). Any other burst counts per CPU
    second of this thread (the hardware's pace: clocks, thermal limits): time the
    scheduler gave to other tenants of a busy shared host is forgiven, so peers on one
    host measure alike. A limit of less than one CPU caps that pace at its share: on a
    host so busy that the thread gets less than its limit anyway, the burst never hits
    the limit, yet the node could never go faster than it allows."""
    import numpy as np  # only when measured: the launcher starts without it

    a = np.random.default_rng(0).standard_normal((_SIDE, _SIDE), dtype=np.float32)
    b = a.copy()
    stat = _cpu_stat_path()
    share = min(1.0, cpu_limit() or 1.0)
    best = 0.0
    for _ in range(bursts):
        n = 0
        t0, c0, h0 = time.perf_counter(), time.thread_time(), throttled_periods(stat)
        end = t0 + burst_s
        while time.perf_counter() < end:
            np.matmul(a, b, out=b)
            b *= 0.01  # keep the values finite
            n += 1
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        held = throttled_periods(stat) != h0
        best = max(best, n / wall if held else share * n / max(cpu, 1e-6))
    return best


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.0f} MiB"


def disk_problems(folders: Iterable[Path], min_free: int) -> list[str]:
    """Folders the job writes (logs, checkpoints) with less than *min_free* bytes free."""
    out: list[str] = []
    for folder in folders:
        where = folder
        while not where.exists() and where != where.parent:
            where = where.parent  # not made yet: the file system it will be made on
        try:
            free = shutil.disk_usage(where).free
        except OSError as err:
            out.append(f"cannot read the free space of {folder}: {err.strerror}")
            continue
        if free < min_free:
            out.append(f"{folder}: {_size(free)} free, expected at least {_size(min_free)}")
    return out


def memory_problem(min_free: int) -> str | None:
    avail = psutil.virtual_memory().available
    if avail < min_free:
        return f"memory: {_size(avail)} available, expected at least {_size(min_free)}"
    return None


def interface_problem(addr: str) -> str | None:
    """The interface holding *addr* (the address peers reach this node at) is down, or
    no interface holds it. A host name is not checked (it resolves elsewhere)."""
    try:
        want = ipaddress.ip_address(addr)
    except ValueError:
        return None
    if want.is_unspecified:
        return None
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            try:
                held = ipaddress.ip_address(a.address.split("%")[0])
            except ValueError:
                continue
            if held == want:
                st = stats.get(name)
                if st is not None and not st.isup:
                    return f"interface {name} (holding {addr}) is down"
                return None
    return f"no interface of this host holds {addr}, the address peers are told to use"
