"""Checkpoints in launcher-owned RAM (issue 16) against reading them back from disk, and DLRover.

Side by side in one run (about 6-10 minutes; every subprocess has a deadline):

0. the floor: what this machine does with the same bytes whoever does it (memcpy into
   written memory, xxh3_64, page-faulting fresh tensors, mapping shared memory).
1. restore: one rank's share of the state (``--size-mib`` per rank) from the launcher's
   snapshot memory, into fresh tensors (``restore()``) and in place into tensors the
   job already has (``restore(into=...)``; through the checkpointer, whose segment is
   already mapped), vs ``torch.load(weights_only=True)`` of the same state from a file
   whose page cache was dropped (``sync; echo 3 > /proc/sys/vm/drop_caches`` as root,
   else ``posix_fadvise DONTNEED``; checked with ``fincore``) and from a warm page cache.
2. crash -> first resumed step: ``stalwart run`` with 2 ranks, each holding
   ``--size-mib``; rank 0 dies right after a save; the time from the crash to the first
   step of the restarted job, restoring in place, from RAM (``--ckpt-ram``) vs disk,
   and where that time goes, stage by stage (the launcher's events and the job's stamps).
2b. the same crash through in-process restart (``bench/ram_inprocess.py``, wrapped in
   ``stalwart.inprocess.Wrapper``): the processes and their tensors survive; the time
   from the fault raised to both ranks' first step after ``restore(into=...)`` from RAM.
3. save stall at every step: a model + Adam of about ``--stall-mib`` trained on the
   CPU, in blocks of steps without and with a RAM-only ``save()`` after every step; the
   stall is the median step time with saves minus without (and the time inside
   ``save()``), SYNC and BACKGROUND staging.
4. DLRover 0.6.1 flash checkpoint (``--dlrover-python``, a separate venv; see
   docs/benchmarks.md), on the same state and model: restore from its shared memory
   and the save stall measured the same way, in a subprocess.

Usage: ``flock /tmp/stalwart-bench.lock .venv/bin/python bench/bench_ram.py --markdown``
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import fmt, kill_leftovers, machine, med, ratio, show, spread  # noqa: E402
from ram_common import make_model, make_state, state_mib, timed_blocks  # noqa: E402

_JOB = r"""
import json, os, sys, time
t_main = time.time()
from pathlib import Path
import torch
from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig

def main():
    out, mib, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    persist = 1 if mode == "disk" else 1000
    stamps = {"main": t_main}
    # What a job has before it restores: its model and optimizer state, built (written).
    state = {f"t{i}": torch.empty(mib << 15).fill_(-1.0) for i in range(8)}
    stamps["state"] = time.time()
    ck = AsyncCheckpointer(out / "ckpt", config=CheckpointerConfig(persist_every=persist))
    stamps["checkpointer"] = time.time()
    marker = out / f"crashed_{rank}"
    if not marker.exists():
        for i, t in enumerate(state.values()):
            t.fill_(float(i + rank))
        ck.save(state, step=10)
        ck.wait()
        if mode == "disk":
            for f in (out / "ckpt").glob(f"step_*/rank_{rank}.pt"):
                fd = os.open(f, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        marker.write_text(repr(time.time()))
        if rank == 0:
            # Crash only once every rank holds its snapshot: a loaded host runs the
            # ranks out of step, and a rank still saving would be restarted unsaved.
            deadline = time.monotonic() + 300
            while not all((out / f"crashed_{r}").exists() for r in range(world)):
                if time.monotonic() > deadline:
                    sys.exit("the other ranks never saved")
                time.sleep(0.01)
            (out / "crash_at").write_text(repr(time.time()))
            os._exit(1)
        time.sleep(600)  # killed by the launcher's restart
    found = ck.restore(into=state)
    stamps["restored"] = time.time()
    t = (found.state_dict["t0"] * 2).sum()  # the first step touches the state
    stamps["step"] = time.time()
    (out / f"resumed_{rank}.json").write_text(json.dumps(
        {"t": stamps["step"], "source": found.source, "step": found.step, "x": float(t),
         "stamps": stamps}))
    ck.close()

if __name__ == "__main__":
    main()
"""


def _resident_bytes(path: Path) -> int | None:
    """Bytes of ``path`` in the page cache (``fincore``), None when that cannot be told."""
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return int(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _drop_cache(path: Path) -> str:
    """Evict ``path`` from the page cache; says how (and whether it worked)."""
    os.sync()
    try:
        # As root: what `sync; echo 3 > /proc/sys/vm/drop_caches` does.
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        how = "drop_caches"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        how = "fadvise"
    left = _resident_bytes(path)
    if left is None:
        return f"{how} (unchecked)"
    return how if left == 0 else f"NOT dropped ({left} bytes resident)"


def _dlrover(python: Path | None, args: list[str]) -> tuple[dict[str, object] | None, str]:
    """Run ram_dlrover.py with DLRover's venv; (result, why not)."""
    if python is None or not python.exists():
        return None, f"no DLRover venv at {python} (see docs/benchmarks.md)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "PYTHONPATH"))}
    env["PYTHONPATH"] = str(ROOT / "bench")
    why = ""
    for _ in range(2):  # its saver may miss its start-up window on a loaded host
        before = _dlrover_leftovers()
        try:
            res = subprocess.run(
                [str(python), str(ROOT / "bench" / "ram_dlrover.py"), *args],
                capture_output=True,
                text=True,
                timeout=300,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return None, "timed out after 300 s"
        finally:
            # It names its shared memory and sockets host-wide (/dev/shm/ckpt_shm_<n>,
            # /tmp/ckpt_sock/) and leaves them when its saver child is killed at exit.
            for left in _dlrover_leftovers() - before:
                left.unlink(missing_ok=True)
        for line in res.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :]), ""
        # The first exception line, not its engine's __del__ complaining afterwards.
        errors = [ln for ln in res.stderr.splitlines() if ln.split(":")[0].endswith("Error")]
        why = f"failed (exit {res.returncode}): {(errors or ['no error line'])[0]}"
        Path("/tmp/stalwart-bench-dlrover.err").write_text(res.stderr)
    return None, why


def _dlrover_leftovers() -> set[Path]:
    return set(Path("/dev/shm").glob("ckpt_shm_*")) | set(Path("/tmp/ckpt_sock").glob("*"))


def bench_restore(mib: int, repeats: int, work: Path, dlrover: Path | None) -> list[list[str]]:
    import torch

    from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig
    from stalwart.checkpoint import ramlayout as rl
    from stalwart.checkpoint.ram import RamSegment
    from stalwart.checkpoint.resume import restore
    from stalwart.checkpoint.staging import plan
    from stalwart.launch.replicas.snapshots import SnapshotMemory

    state = make_state(mib)
    into = {k: torch.empty_like(v).fill_(-1.0) for k, v in state.items()}
    mem = SnapshotMemory(1, (mib << 20) + (8 << 20))
    os.environ.update(mem.worker_env())
    os.environ["LOCAL_RANK"] = "0"
    fresh: list[float] = []
    in_place: list[float] = []
    own: list[float] = []
    disk_cold: list[float] = []
    disk_warm: list[float] = []
    dropped: set[str] = set()
    try:
        seg = RamSegment.open(mem.folder / rl.segment_name(0))
        seg.write(plan(state), 1, rank=0, world_size=1, threads=4)
        seg.close()
        ck = AsyncCheckpointer(
            work / "own", rank=0, world_size=1, config=CheckpointerConfig(persist_every=10**6)
        )
        try:
            assert ck.restore(into=into) is not None
            # The restore started pre-faulting the whole segment for saves; timing the
            # restores meanwhile would measure that too.
            assert ck._ram is not None
            ck._ram.wait_populated()
            for _ in range(repeats):
                t0 = time.perf_counter()
                found = restore(work / "none", rank=0, world_size=1)
                fresh.append(time.perf_counter() - t0)
                assert found is not None and found.source == "ram"
                del found
                for t in into.values():
                    t.fill_(-1.0)
                t0 = time.perf_counter()
                found = restore(work / "none", rank=0, world_size=1, into=into)
                in_place.append(time.perf_counter() - t0)
                assert found is not None and torch.equal(into["t3"], state["t3"])
                for t in into.values():
                    t.fill_(-1.0)
                t0 = time.perf_counter()
                found = ck.restore(into=into)
                own.append(time.perf_counter() - t0)
                assert found is not None and torch.equal(into["t5"], state["t5"])
                del found
        finally:
            ck.close()
        path = work / "state.pt"
        torch.save(state, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        for _ in range(repeats):
            dropped.add(_drop_cache(path))
            t0 = time.perf_counter()
            loaded = torch.load(path, weights_only=True)
            disk_cold.append(time.perf_counter() - t0)
            del loaded
            t0 = time.perf_counter()
            loaded = torch.load(path, weights_only=True)
            disk_warm.append(time.perf_counter() - t0)
            del loaded
        path.unlink()
    finally:
        mem.close()
    gib = mib / 1024
    base = med(disk_cold)

    def row(name: str, xs: list[float]) -> list[str]:
        return [
            name,
            spread(xs, digits=3),
            fmt((med(xs) or 0) / gib, "s/GiB", 3),
            ratio(med(xs), base),
        ]

    rows = [
        row("stalwart RAM: restore() into fresh tensors", fresh),
        row("stalwart RAM: restore(into=existing tensors)", in_place),
        row("stalwart RAM: AsyncCheckpointer.restore(into=...), segment mapped", own),
        row(f"torch.load, disk, page cache dropped ({'/'.join(sorted(dropped))})", disk_cold),
        row("torch.load, page cache warm", disk_warm),
    ]
    result, why = _dlrover(dlrover, ["restore", str(mib), str(repeats)])
    if result is None:
        rows.append(["DLRover flash checkpoint", why, "", ""])
    else:
        views = [float(x) for x in result["views"]]  # type: ignore[attr-defined]
        copied = [float(x) for x in result["copied"]]  # type: ignore[attr-defined]
        rows.append(row("DLRover: load_checkpoint() (views of its shm, no checksum)", views))
        rows.append(row("DLRover: load_checkpoint() + copy into existing tensors", copied))
    return rows


#: The crash path's stages: (name, from stamp, to stamp); stamps in ``_stamps``.
_STAGES = (
    ("exit seen", "crash", "exit"),
    ("others stopped", "exit", "stopped"),
    ("respawned", "stopped", "spawn"),
    ("job builds its state", "main", "state"),
    ("AsyncCheckpointer()", "state", "checkpointer"),
    ("restore(into=...)", "checkpointer", "restored"),
    ("first step", "restored", "step"),
)
_CRASH_TIMEOUT_S = 180


def _stamps(out: Path) -> dict[str, float]:
    """When each stage of one crash run ended (wall clock): the job's own stamps (the
    slower rank's) and the launcher's events (``events.jsonl``)."""
    crash = float((out / "crash_at").read_text())
    resumed = [json.loads((out / f"resumed_{r}.json").read_text()) for r in (0, 1)]
    stamps = {k: max(r["stamps"][k] for r in resumed) for k in resumed[0]["stamps"]}
    stamps["crash"] = crash
    events = [json.loads(ln) for f in out.glob("logs/*/events.jsonl") for ln in f.open()]
    exits = [e for e in events if e["event"] == "worker_exit" and e.get("attempt") == 0]
    spawns = [e for e in events if e["event"] == "worker_spawn" and e.get("attempt") == 1]
    if exits and spawns:
        stamps["exit"] = min(float(e.get("exited_at") or e["time"]) for e in exits)
        stamps["stopped"] = max(float(e.get("exited_at") or e["time"]) for e in exits)
        stamps["spawn"] = max(float(e["time"]) for e in spawns)
    return stamps


def _run_job(
    cmd: list[str], out: Path, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str] | None:
    """Runs one launcher command outside any surrounding job; None (after killing what is
    left of it) when it outlives the bench's bound."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "TORCHELASTIC_"))}
    env.update(extra_env or {})
    try:
        return subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=_CRASH_TIMEOUT_S, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        kill_leftovers(out)
        return None


def _crash_once(mode: str, mib: int, work: Path) -> tuple[dict[str, float] | None, str]:
    out = Path(tempfile.mkdtemp(dir=work, prefix=f"crash-{mode}-"))
    script = out / "job.py"
    script.write_text(_JOB)
    cmd = [sys.executable, "-m", "stalwart.cli", "run", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1", "--log-dir", str(out / "logs")]
    if mode == "ram":
        cmd += ["--ckpt-ram", f"{mib + 8}MiB"]
    cmd += [str(script), str(out), str(mib), mode]
    res = _run_job(cmd, out)
    if res is None:
        return None, f"timed out after {_CRASH_TIMEOUT_S} s"
    try:
        stamps = _stamps(out)
        resumed = [json.loads((out / f"resumed_{r}.json").read_text()) for r in (0, 1)]
    except (OSError, ValueError, KeyError):
        return None, f"failed (exit {res.returncode}): {res.stderr[-300:]}"
    return stamps, "/".join(sorted({r["source"] for r in resumed}))


def bench_crash(mib: int, repeats: int, work: Path) -> tuple[list[list[str]], list[list[str]]]:
    """(crash -> first resumed step per mode, the median of each stage per mode)."""
    runs: dict[str, list[dict[str, float]]] = {"ram": [], "disk": []}
    source: dict[str, str] = {"ram": "", "disk": ""}
    for _ in range(repeats):
        for mode in ("ram", "disk"):  # interleaved: the load drifts
            stamps, source[mode] = _crash_once(mode, mib, work)
            if stamps is not None:
                runs[mode].append(stamps)
    total = {m: [r["step"] - r["crash"] for r in runs[m]] for m in runs}
    rows = [
        [f"resume from {m}", source[m], spread(total[m]), ratio(med(total[m]), med(total["disk"]))]
        for m in ("ram", "disk")
    ]
    stages = []
    for name, a, b in _STAGES:
        row = [name]
        for m in ("ram", "disk"):
            xs = [r[b] - r[a] for r in runs[m] if a in r and b in r]
            row.append(fmt(med(xs), "s", 3))
        stages.append(row)
    return rows, stages


#: The in-process path's stages: (name, from stamp, to stamp); stamps in ``_inprocess_once``.
_IP_STAGES = (
    ("restart began (both ranks re-entered)", "fault", "began"),
    ("process group set up again (init_process_group)", "began", "grouped"),
    ("restore(into=...) from RAM", "grouped", "restored"),
    ("first step", "restored", "step"),
)


def _inprocess_once(mib: int, work: Path) -> tuple[dict[str, float] | None, str]:
    """One run of ``ram_inprocess.py``: rank 1 raises once both ranks committed step 2; both ranks
    restart in process and restore in place. Stamps are wall clock, the slower rank's."""
    out = Path(tempfile.mkdtemp(dir=work, prefix="crash-inprocess-"))
    cmd = [sys.executable, "-m", "stalwart.cli", "run", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "0", "--log-dir", str(out / "logs"), "--ckpt-ram", f"{mib + 8}MiB"]
    cmd += [str(ROOT / "bench" / "ram_inprocess.py"), str(out), str(mib), "2", "4"]
    res = _run_job(cmd, out)
    if res is None:
        return None, f"timed out after {_CRASH_TIMEOUT_S} s"
    try:
        runs = [json.loads((out / f"run_{r}.json").read_text()) for r in (0, 1)]
        second = [log[1] for log in runs]
        stamps = {
            "fault": float(runs[1][0]["fault"]),
            "began": max(float(r["began"]) for r in second),
            "grouped": max(float(r["grouped"]) for r in second),
            "restored": max(float(r["restored"]) for r in second),
            "step": max(float(r["first_step"]) for r in second),
        }
    except (OSError, ValueError, KeyError, IndexError):
        return None, f"failed (exit {res.returncode}): {res.stderr[-300:]}"
    return stamps, "/".join(sorted({str(r["source"]) for r in second}))


def bench_inprocess(mib: int, repeats: int, work: Path) -> tuple[list[list[str]], list[list[str]]]:
    """(crash -> first resumed step through in-process restart, its stages' medians)."""
    runs: list[dict[str, float]] = []
    source = ""
    for _ in range(repeats):
        stamps, source = _inprocess_once(mib, work)
        if stamps is not None:
            runs.append(stamps)
    total = [r["step"] - r["fault"] for r in runs]
    rows = [["in-process restart + restore(into=...)", source, spread(total)]]
    stages = []
    for name, a, b in _IP_STAGES:
        stages.append([name, spread([r[b] - r[a] for r in runs])])
    return rows, stages


#: The full-speed section's launchers: (row name, saver, command before the job, fault kinds).
_FULL_MODES = (
    ("torchrun + torch.save/torch.load (local disk)", "torch", "torchrun", ("crash", "kill")),
    ("stalwart --no-warm, --ckpt-ram", "ram", "cold", ("crash", "kill")),
    ("stalwart (warm), --ckpt-ram", "ram", "warm", ("crash", "kill")),
    ("stalwart in-process (Wrapper), --ckpt-ram", "ram", "inprocess", ("crash",)),
)


def _full_command(launcher: str, mib: int, out: Path, a: argparse.Namespace) -> list[str]:
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    else:
        cmd = [sys.executable, "-m", "stalwart.cli", "run", "--log-dir", str(out / "logs")]
        cmd += ["--ckpt-ram", f"{mib + 8}MiB"]
        cmd += ["--no-warm"] if launcher == "cold" else []
    restarts = "0" if launcher == "inprocess" else "1"
    cmd += ["--nproc-per-node", "2", "--max-restarts", restarts]
    return cmd


def _full_once(
    launcher: str, saver: str, fault: str, mib: int, work: Path, a: argparse.Namespace
) -> dict[str, float] | None:
    """One run of ram_fullspeed.py: (first resumed step, back at full speed, stages), from
    the fault; None when it did not get there."""
    from stalwart.reporting.goodput import full_speed_at

    out = Path(tempfile.mkdtemp(dir=work, prefix=f"full-{launcher}-{fault}-"))
    cmd = _full_command(launcher, mib, out, a)
    cmd += [str(ROOT / "bench" / "ram_fullspeed.py"), str(out), str(mib), str(a.full_steps)]
    cmd += [str(a.full_save_every), str(a.full_fault_at), fault, saver]
    cmd += ["--inprocess"] if launcher == "inprocess" else []
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if launcher == "torchrun" else {}
    res = _run_job(cmd, out, env)
    try:
        recs = [json.loads(x) for x in (out / "p.jsonl").read_text().splitlines()]
        fault_at = float((out / "fault").read_text())
    except (OSError, ValueError):
        print(f"{launcher}/{fault}: no result ({res and res.returncode})", file=sys.stderr)
        return None
    before = sorted((float(r["time"]), int(r["step"])) for r in recs if r["attempt"] == 0)
    after = sorted((float(r["time"]), int(r["step"])) for r in recs if r["attempt"] == 1)
    if not after:
        print(f"{launcher}/{fault}: no resumed step", file=sys.stderr)
        return None
    row = {"first": after[0][0] - fault_at}
    # The loop's own pace before the fault, saves included: a step a restart cannot beat.
    paces = [b[0] - a[0] for a, b in itertools.pairwise(before)]
    if paces:
        row["pace"] = sorted(paces)[len(paces) // 2]
    back = full_speed_at(before, after, a.full_save_every)
    if back is not None:
        row["full"] = back - fault_at
    for r in (0, 1):
        stamps_file = out / f"stamps_1_{r}.json"
        if stamps_file.exists():
            st = json.loads(stamps_file.read_text())
            for k in ("main", "state", "began", "restored", "step"):
                row[k] = max(row.get(k, 0.0), float(st[k]) - fault_at)
    evs = [json.loads(ln) for f in out.glob("logs/*/events.jsonl") for ln in f.open()]
    exits = [e for e in evs if e["event"] == "worker_exit" and e.get("attempt") == 0]
    spawns = [e for e in evs if e["event"] == "worker_spawn" and e.get("attempt") == 1]
    if exits and spawns:
        row["exit"] = min(float(e.get("exited_at") or e["time"]) for e in exits) - fault_at
        row["stopped"] = max(float(e.get("exited_at") or e["time"]) for e in exits) - fault_at
        row["spawn"] = max(float(e["time"]) for e in spawns) - fault_at
    return row


#: Stages of the full-speed runs, as times since the fault (the slower rank's).
_FULL_STAGES = (
    ("failed rank exited", "exit"),
    ("all old workers exited", "stopped"),
    ("new workers spawned", "spawn"),
    ("job built its state (written)", "state"),
    ("restored", "restored"),
    ("first step done", "step"),
)


def bench_fullspeed(
    mib: int, work: Path, a: argparse.Namespace
) -> tuple[list[list[str]], list[list[str]]]:
    """(crash/SIGKILL -> first resumed step and -> back at full speed per launcher, the
    stages of each launcher's crash runs)."""
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(a.repeats):
        for name, saver, launcher, faults in _FULL_MODES:  # interleaved: the load drifts
            for fault in faults:
                row = _full_once(launcher, saver, fault, mib, work, a)
                runs.setdefault((name, fault), [])
                if row is not None:
                    runs[(name, fault)].append(row)
    rows = []
    for (name, fault), xs in runs.items():
        rows.append(
            [
                name,
                fault,
                f"{len(xs)}/{a.repeats}",
                spread([x["first"] for x in xs]),
                spread([x["full"] for x in xs if "full" in x]),
                fmt(med([x["pace"] for x in xs if "pace" in x]), "s", 3),
            ]
        )
    stages = []
    for label, key in _FULL_STAGES:
        stage = [label]
        for name, _saver, _launcher, _faults in _FULL_MODES:
            stage.append(fmt(med([x[key] for x in runs[(name, "crash")] if key in x]), "s", 2))
        stages.append(stage)
    return rows, stages


def bench_floor(mib: int, repeats: int) -> list[list[str]]:
    """What this machine can do with ``mib`` MiB, whoever does it: the floor of a restore."""
    import mmap

    import torch
    import xxhash

    n = mib << 20
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    threads = torch.get_num_threads()

    def timed(fn: object) -> list[float]:
        xs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            xs.append(time.perf_counter() - t0)
        return xs

    rows: list[tuple[str, list[float]]] = []
    for k in (1, 2):
        torch.set_num_threads(k)
        rows.append(
            (
                f"memcpy into written memory (torch copy_, {k} thread(s))",
                timed(lambda: dst.copy_(src)),
            )
        )
    torch.set_num_threads(threads)
    view = memoryview(src.numpy())
    rows.append(("xxh3_64 (python xxhash)", timed(lambda: xxhash.xxh3_64_intdigest(view))))
    rows.append(
        (
            "fresh tensor: allocate + first write (page faults)",
            timed(lambda: torch.empty(n, dtype=torch.uint8).fill_(1)),
        )
    )
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        os.posix_fallocate(f.fileno(), 0, n)

        def populate() -> None:
            with mmap.mmap(f.fileno(), n, prot=mmap.PROT_READ) as m:
                m.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))

        rows.append(("map shared memory + MADV_POPULATE_READ", timed(populate)))
    gib = mib / 1024
    return [
        [name, spread(xs, digits=3), fmt((med(xs) or 0) / gib, "s/GiB", 3)] for name, xs in rows
    ]


def _stall_row(
    name: str, mib: float, plain: list[float], saving: list[float], inside: list[float]
) -> list[str]:
    p, w = med(plain), med(saving)
    extra = None if p is None or w is None else w - p
    return [
        name,
        f"{mib:.0f} MiB",
        fmt(p, "s", 4),
        fmt(w, "s", 4),
        fmt(med(inside), "s", 4),
        "n/a" if extra is None or not p else f"{extra / p * 100:+.1f} %",
        "n/a" if not p else f"{(med(inside) or 0) / p * 100:.1f} %",
    ]


def bench_stall(
    mib: int, blocks: int, per_block: int, work: Path, dlrover: Path | None
) -> list[list[str]]:
    from stalwart.checkpoint import AsyncCheckpointer, CheckpointerConfig, StagingMode
    from stalwart.launch.replicas.snapshots import SnapshotMemory

    model, opt, step = make_model(mib)
    total = state_mib(model, opt)
    mem = SnapshotMemory(1, int(total * 1.2) << 20)
    os.environ.update(mem.worker_env())
    os.environ["LOCAL_RANK"] = "0"
    rows = []
    try:
        for staging in (StagingMode.SYNC, StagingMode.BACKGROUND):
            config = CheckpointerConfig(persist_every=10**6, staging=staging)
            with AsyncCheckpointer(work / "stall", rank=0, world_size=1, config=config) as ck:

                def save(n: int) -> None:
                    ck.save({"model": model.state_dict(), "optim": opt.state_dict()}, n)

                for n in range(3):  # warm: the first copies fault the mapping in
                    save(n + 10**6)
                ck.wait()
                plain, saving, inside = timed_blocks(step, save, blocks, per_block)
            rows.append(
                _stall_row(f"stalwart RAM, {staging.value} staging", total, plain, saving, inside)
            )
    finally:
        mem.close()
    result, why = _dlrover(dlrover, ["stall", str(mib), str(blocks), str(per_block)])
    if result is None:
        rows.append(["DLRover flash checkpoint (MEMORY)", why, "", "", "", "", ""])
    else:
        rows.append(
            _stall_row(
                "DLRover flash checkpoint (MEMORY)",
                float(result["state_mib"]),  # type: ignore[arg-type]
                [float(x) for x in result["plain"]],  # type: ignore[attr-defined]
                [float(x) for x in result["saving"]],  # type: ignore[attr-defined]
                [float(x) for x in result["inside"]],  # type: ignore[attr-defined]
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=512, help="state per rank")
    ap.add_argument("--stall-mib", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=4, help="stall: blocks with and without saves")
    ap.add_argument("--per-block", type=int, default=6, help="stall: steps per block")
    ap.add_argument("--dlrover-python", type=Path, default=ROOT / ".venv-dlrover/bin/python")
    ap.add_argument("--full-steps", type=int, default=90, help="fullspeed: steps of the job")
    ap.add_argument("--full-save-every", type=int, default=10, help="fullspeed: steps per save")
    ap.add_argument("--full-fault-at", type=int, default=45, help="fullspeed: the faulty step")
    ap.add_argument(
        "--skip",
        default="",
        help="comma list of floor,restore,crash,inprocess,fullspeed,stall",
    )
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    print(f"machine: {machine()}; {time.strftime('%H:%M UTC', time.gmtime())}; load {_load()}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", "/tmp")) as tmp:
        work = Path(tmp)
        if "floor" not in skip:
            show(
                f"the floor: {a.size_mib} MiB on this machine, min / median / max of {a.repeats}",
                ["operation", "time", "per GiB"],
                bench_floor(a.size_mib, a.repeats),
                a.markdown,
            )
        if "restore" not in skip:
            show(
                f"restore {a.size_mib} MiB (one rank's share), min / median / max of {a.repeats}",
                ["from", "time", "per GiB", "vs torch.load cold"],
                bench_restore(a.size_mib, a.repeats, work, a.dlrover_python),
                a.markdown,
            )
        if "crash" not in skip:
            crash, stages = bench_crash(a.size_mib, a.repeats, work)
            show(
                f"crash -> first resumed step, 2 ranks x {a.size_mib} MiB, warm restart, "
                f"restore(into=...), min / median / max of {a.repeats}",
                ["mode", "restored from", "time", "vs disk"],
                crash,
                a.markdown,
            )
            show(
                "where the crash -> resumed time goes (medians; job stages: the slower rank)",
                ["stage", "from RAM", "from disk"],
                stages,
                a.markdown,
            )
        if "inprocess" not in skip:
            crash, stages = bench_inprocess(a.size_mib, a.repeats, work)
            show(
                f"crash -> first resumed step, 2 ranks x {a.size_mib} MiB, in-process restart "
                f"(stalwart.inprocess.Wrapper) + restore(into=...) from RAM, "
                f"min / median / max of {a.repeats}",
                ["mode", "restored from", "time"],
                crash,
                a.markdown,
            )
            show(
                "where the in-process crash -> resumed time goes (the slower rank)",
                ["stage", "time"],
                stages,
                a.markdown,
            )
        if "fullspeed" not in skip:
            full, stages = bench_fullspeed(a.size_mib, work, a)
            show(
                f"fault -> first resumed step and -> back at full speed, 2 ranks x "
                f"{a.size_mib} MiB, a save every {a.full_save_every} steps, fault at step "
                f"{a.full_fault_at}, min / median / max of {a.repeats}",
                [
                    "launcher + checkpoint",
                    "fault",
                    "resumed",
                    "first resumed step",
                    "back at full speed",
                    "step before the fault (median)",
                ],
                full,
                a.markdown,
            )
            show(
                "where the crash -> back time goes: each stage's end after the fault "
                "(medians, the slower rank)",
                ["stage", *(m[0] for m in _FULL_MODES)],
                stages,
                a.markdown,
            )
        if "stall" not in skip:
            show(
                f"save stall at every step: {a.blocks} blocks of {a.per_block} steps without "
                "and with a save (RAM only), medians",
                [
                    "saver",
                    "state",
                    "step",
                    "step + save",
                    "in save()",
                    "stall / step",
                    "in save() / step",
                ],
                bench_stall(a.stall_mib, a.blocks, a.per_block, work, a.dlrover_python),
                a.markdown,
            )
    print(f"load at the end: {_load()}")


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
