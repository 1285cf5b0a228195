"""Sharded checkpoints: an FSDP2 model + AdamW on 2 gloo ranks, DCP vs stalwart's DCP path.

    .venv/bin/python bench/bench_dcp.py [--mib 384] [--repeats 3] [--markdown]
        [--sections save,restore,crash]   (as root: it drops the page cache)

Measured in the same two processes, interleaved, per repeat:
  - stall (the save call returns), staged (the state may change again: the staging
    future resolved) and durable (the step is on disk, fsync'd) for
    dcp.async_save with its default stager, with its asynchronous stager
    (DefaultStager, use_async_staging), and stalwart's AsyncDcpSaver (DcpWriter
    + ReusingStager: commit record, checksums, keep-last) with its shards written by
    the writer subprocess (default) and by DCP's thread in the rank;
  - a plain write of the same bytes with fsync (the disk's limit);
  - restore: dcp.load vs stalwart's load_newest (which also verifies every
    checksum), both after dropping the files from the page cache.
--mib is the parameter size; AdamW's two moments triple it (384 -> 1.1 GiB in all).
Each rank prints JSON lines; rank 0's parent prints medians and ratios with `uptime`.

Two more sections run the job the way a user would (bench/dcp_crash_job.py, the same
model and optimizer), under a launcher:
  - restore (``stalwart run --ckpt-ram``): a rank SIGKILLs itself after a save; the
    restarted ranks load the step ``--repeats`` times each way, the page cache dropped
    before each: dcp.load, load_newest from disk, load_newest from RAM, and plain
    dcp.load(storage_reader=DcpReader(...)) (from RAM);
  - crash (``--repeats`` runs each): crash -> first resumed step of the job saving with
    plain dcp.save under torchrun (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without
    which its restarts fail on gloo) vs stalwart's dcp.save under
    ``stalwart run --ckpt-ram``: the same script, model, step count and clock (wall
    time from the job's ranks), then where the seconds went, stage by stage (the
    launcher's log or events, the restarted ranks' own marks, with their CPU seconds).
    A run in which stalwart killed a rank as hung (the job never hangs) is counted,
    named and rerun.
A fourth, ``peer`` (bench/dcp_peer.py: three simulated hosts, network namespaces), times
the restore of a lost node's rank from a peer's replica against dcp.load in one run.
``--sections`` picks them (default: save,restore,crash); ``--keep`` keeps the run folders.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# "stalwart": shards written by the writer subprocess from the shared memory the stager
# staged into (the default: one copy of each tensor); "stalwart (in-rank writes)": by
# DCP's thread in the rank.
SAVES = ("dcp default", "dcp async stager", "stalwart", "stalwart (in-rank writes)", "plain write")
ROOT = HERE.parent
JOB = HERE / "dcp_crash_job.py"
SECTIONS = ("save", "restore", "crash", "peer")
#: The step after whose save a rank of the crash job dies.
CRASH_AT = 2
#: Bound on one launcher run of the job.
JOB_TIMEOUT_S = 420


def _drop_cache(folder: Path) -> str:
    """Evict a folder's files from the page cache (the whole cache when allowed)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "drop_caches"
    except OSError:
        for p in folder.rglob("*"):
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "fadvise"


def rank_main(ns: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from stalwart.checkpoint import dcp as sdcp
    from stalwart.checkpoint.process_args import DCP_WRITER_NICE, WriterProcessConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    side = 2048
    layers = max(1, round(ns.mib * 2**20 / (side * side * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, side)).sum().backward()
    optim.step()
    m, o = get_state_dict(model, optim)
    state = {"model": m, "optim": o}
    local = sum(
        t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else 0
        for t in [*m.values(), *[v for s in o["state"].values() for v in s.values()]]
    )
    total = torch.tensor([local])
    dist.all_reduce(total)
    work = Path(ns.work)
    ckpt_group = dist.new_group(backend="gloo")
    saver = sdcp.AsyncDcpSaver(
        work / "stalwart",
        keep_last=2,
        process_group=ckpt_group,
        # A loaded host can take over a minute to start an interpreter that imports torch.
        writer_config=WriterProcessConfig(init_timeout_s=600.0, writer_nice=DCP_WRITER_NICE),
    )
    # The same saver with DCP writing the shards on its own thread in the rank (the
    # path before the writer subprocess), for the before/after rows.
    thread_saver = sdcp.AsyncDcpSaver(
        work / "stalwart-thread", keep_last=2, process_group=ckpt_group, subprocess=False
    )
    async_stager = DefaultStager(StagingOptions(False, False, True, False))
    if saver.shard_process is not None:
        # A save before the writer answered writes in the rank: time the subprocess.
        saver.shard_process.wait_ready(timeout=600)

    def emit(**rec: object) -> None:
        if rank == 0:
            print(json.dumps(rec), flush=True)

    emit(kind="size", total_bytes=int(total.item()), layers=layers)
    for rep in range(ns.repeats):
        for method in SAVES:
            dist.barrier()
            folder = work / f"plain-{rep}" if method != "stalwart" else None
            t0 = time.perf_counter()
            if method == "dcp default":
                fut = dcp.async_save(state, checkpoint_id=folder, process_group=ckpt_group)
                stall = staged = time.perf_counter() - t0
                fut.result()
            elif method == "dcp async stager":
                resp = dcp.async_save(
                    state,
                    checkpoint_id=work / f"astager-{rep}",
                    process_group=ckpt_group,
                    async_stager=async_stager,
                )
                stall = time.perf_counter() - t0
                resp.staging_completion.result()  # type: ignore[union-attr]
                staged = time.perf_counter() - t0
                resp.upload_completion.result()  # type: ignore[union-attr]
            elif method.startswith("stalwart"):
                chosen = saver if method == "stalwart" else thread_saver
                staging, done = chosen.save(state, rep + 1)
                stall = time.perf_counter() - t0
                staging.result()
                staged = time.perf_counter() - t0
                done.result()
            else:
                out = work / f"raw-{rep}-{rank}"
                with open(out, "wb") as f:
                    for t in [*m.values(), *[v for s in o["state"].values() for v in s.values()]]:
                        if hasattr(t, "to_local"):
                            f.write(memoryview(t.to_local().contiguous().view(torch.uint8).numpy()))
                    f.flush()
                    os.fsync(f.fileno())
                stall = staged = time.perf_counter() - t0
            durable = time.perf_counter() - t0
            dist.barrier()
            emit(kind="save", method=method, rep=rep, stall=stall, staged=staged, durable=durable)
        # Restore: both read from a cold page cache.
        for method in ("dcp.load", "stalwart load_newest"):
            dist.barrier()
            if rank == 0:
                how = _drop_cache(work)
            dist.barrier()
            t0 = time.perf_counter()
            if method == "dcp.load":
                dcp.load(state, checkpoint_id=work / f"plain-{rep}", process_group=ckpt_group)
            else:
                step = sdcp.load_newest(state, work / "stalwart", process_group=ckpt_group)
                assert step == rep + 1, step
            took = time.perf_counter() - t0
            dist.barrier()
            emit(kind="load", method=method, rep=rep, took=took, cache=how if rank == 0 else "")
        if rank == 0:
            for name in (f"plain-{rep}", f"astager-{rep}"):
                shutil.rmtree(work / name, ignore_errors=True)
        for p in work.glob(f"raw-{rep}-*"):
            p.unlink(missing_ok=True)
    saver.close()
    thread_saver.close()
    async_stager.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=384, help="parameter MiB (x3 with AdamW)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument(
        "--sections", default="save,restore,crash", help="save,restore,crash,peer (peer: netns)"
    )
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    ap.add_argument(
        "--keep", action="store_true", help="keep the restore and crash sections' run folders"
    )
    ns = ap.parse_args()
    if ns.mib < 1 or ns.repeats < 1:
        print(f"bench_dcp: --mib {ns.mib} / --repeats {ns.repeats}: expected >= 1", file=sys.stderr)
        return 2
    sections = [x for x in ns.sections.split(",") if x]
    if not sections or set(sections) - set(SECTIONS):
        print(
            f"bench_dcp: --sections {ns.sections!r}: expected some of {SECTIONS}", file=sys.stderr
        )
        return 2
    if ns.rank:
        rank_main(ns)
        return 0
    rc = save_section(ns) if "save" in sections else 0
    from dcp_peer import peer_section

    for name, fn in (
        ("restore", restore_section),
        ("crash", crash_section),
        ("peer", peer_section),
    ):
        if name in sections:
            work = Path(tempfile.mkdtemp(prefix=f"stalwart-bench-dcp-{name}-"))
            try:
                rc = fn(ns, work) or rc
            finally:
                if ns.keep:
                    print(f"bench_dcp: {name} section's runs kept in {work}", file=sys.stderr)
                else:
                    shutil.rmtree(work, ignore_errors=True)
    return rc


def save_section(ns: argparse.Namespace) -> int:
    load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-dcp-"))
    port = 29500 + os.getpid() % 1000
    procs = []
    try:
        for rank in range(2):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PYTHONWARNINGS": "ignore",
            }
            args = [sys.executable, __file__, "--rank", "--work", str(work)]
            args += ["--mib", str(ns.mib), "--repeats", str(ns.repeats)]
            procs.append(
                subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
            )
        out, _ = procs[0].communicate()
        for p in procs[1:]:
            p.wait()
        if any(p.returncode for p in procs):
            print(f"bench_dcp: a rank failed: {[p.returncode for p in procs]}", file=sys.stderr)
            return 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
    load_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    recs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    report(recs, ns, load_before, load_after)
    return 0


def report(recs: list[dict], ns: argparse.Namespace, before: str, after: str) -> None:
    size = next(r for r in recs if r["kind"] == "size")
    gib = size["total_bytes"] / 2**30
    med = statistics.median
    print(
        f"### DCP on FSDP2: 2 ranks, gloo, {gib:.2f} GiB of state (model + AdamW), "
        f"{ns.repeats} repeats, medians\n"
    )
    print(f"- load before: `{before}`")
    print(f"- load after: `{after}`\n")
    saves = [r for r in recs if r["kind"] == "save"]
    plain = med([r["durable"] for r in saves if r["method"] == "plain write"])
    astall = med([r["stall"] for r in saves if r["method"] == "dcp async stager"])
    # Stalls are milliseconds: the spread says what the median alone hides.
    print(
        "| save | stall ms (min / median / max) | staged s | durable s "
        "| durable ÷ plain write | stall ÷ DCP async stager |"
    )
    print("|---|---|---|---|---|---|")
    for method in SAVES:
        rows = [r for r in saves if r["method"] == method]
        stalls = [r["stall"] * 1e3 for r in rows]
        stall, durable = med(stalls) / 1e3, med([r["durable"] for r in rows])
        print(
            f"| {method} | {min(stalls):.1f} / {med(stalls):.1f} / {max(stalls):.1f} | "
            f"{med([r['staged'] for r in rows]):.3f} | {durable:.3f} | {durable / plain:.2f} | "
            f"{stall / astall if astall else float('nan'):.2f} |"
        )
    loads = [r for r in recs if r["kind"] == "load"]
    base = med([r["took"] for r in loads if r["method"] == "dcp.load"])
    cache = next((r["cache"] for r in loads if r["cache"]), "")
    print(f"\n| restore (page cache dropped: {cache}) | s | ÷ dcp.load |")
    print("|---|---|---|")
    for method in ("dcp.load", "stalwart load_newest"):
        took = med([r["took"] for r in loads if r["method"] == method])
        print(f"| {method} | {took:.3f} | {took / base:.2f} |")


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _launch(cmd: list[str], out: Path, env: dict[str, str]) -> str:
    """Run one launcher command outside any surrounding job; '' or why it failed."""
    from common import kill_leftovers

    base = {k: v for k, v in os.environ.items() if not k.startswith(("STALWART_", "TORCHELASTIC_"))}
    try:
        res = subprocess.run(
            [str(c) for c in cmd],
            env={**base, "PYTHONWARNINGS": "ignore", **env},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        kill_leftovers(out)
        return f"timed out after {JOB_TIMEOUT_S} s"
    (out / "launcher.log").write_text(res.stdout + res.stderr)
    return "" if res.returncode == 0 else f"exit {res.returncode}: {res.stderr[-400:]}"


def _events(out: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    except OSError:
        return []


def _stalwart(out: Path, ns: argparse.Namespace) -> list[str]:
    # Two snapshot slots of one rank's share (half of model + AdamW) and its metadata.
    # No timeout configured: hang detection runs as a user gets it, and a restore that
    # takes seconds is not a hang.
    return [
        sys.executable, "-m", "stalwart.cli", "run", "--nproc-per-node", "2",
        "--max-restarts", "1", "--log-dir", out / "logs",
        "--ckpt-ram", f"{3 * ns.mib + 64}MiB",
    ]  # fmt: skip


def restore_section(ns: argparse.Namespace, work: Path) -> int:
    """dcp.load vs load_newest from disk and from RAM, in one restarted job."""
    before = _uptime()
    ckpt = work / "ckpt"
    ckpt.mkdir()
    # The loads are measured here, not hang detection: at load 27-43 a heartbeat
    # timeout learned from the first steps judged a rank hung during the three 1.1 GiB
    # saves, and with the one restart spent the section had no figure (twice).
    cmd = [*_stalwart(work, ns), "--hb-timeout", "600"]
    why = _launch([*cmd, JOB, "restore", work, ckpt, ns.mib, ns.repeats], work, {})
    after = _uptime()
    recs = _events(work)
    loads = [r for r in recs if r["kind"] == "load"]
    if why or not loads:
        print(f"bench_dcp: restore section failed: {why or 'no loads'}", file=sys.stderr)
        return 1
    size = next((r["total_bytes"] for r in recs if r["kind"] == "size"), 0)
    sources = [
        json.loads(line).get("source")
        for f in work.glob("logs/*/events.jsonl")
        for line in f.read_text().splitlines()
        if '"checkpoint_restored"' in line
    ]
    med = statistics.median
    print(
        f"\n### Restore under `stalwart run --ckpt-ram`: a restarted job, 2 ranks, "
        f"{size / 2**30:.2f} GiB of state, {ns.repeats} loads each way, page cache dropped "
        "(drop_caches) before each, medians\n"
    )
    print(f"- load before: `{before}`")
    print(f"- load after: `{after}`")
    print(
        f"- restores the launcher logged, by source: ram {sources.count('ram')}, "
        f"disk {sources.count('disk')} (2 ranks per load)\n"
    )
    base = med([r["took"] for r in loads if r["method"] == "dcp.load"])
    print("| restore | s (min / median / max) | ÷ dcp.load | every load equal to the save |")
    print("|---|---|---|---|")
    for method in ("dcp.load", "load_newest disk", "load_newest ram", "DcpReader ram"):
        rows = [r for r in loads if r["method"] == method]
        xs = [r["took"] for r in rows]
        print(
            f"| {method} | {min(xs):.3f} / {med(xs):.3f} / {max(xs):.3f} | "
            f"{med(xs) / base:.2f} | {all(r['ok'] for r in rows)} |"
        )
    return 0


# The crash section's breakdown: what each row is, in order. The launcher's rows come from
# its own log (torchrun) or events.jsonl (stalwart); the job's from the stages it writes
# (bench/dcp_crash_job.py), the slowest rank's, after the restart.
LAUNCHER_STAGES = (
    ("noticed", "failure noticed (the launcher starts stopping the rest)"),
    ("gone", "old workers gone"),
)
JOB_STAGES = (
    ("process", "new workers' processes made"),
    ("script", "the script's first line runs"),
    ("imported", "its imports done (torch, DCP, FSDP)"),
    ("process_group", "process group up"),
    ("model", "model sharded, optimizer made"),
    ("restored", "state restored"),
    ("step3_forward", "first step: forward"),
    ("step3_backward", "first step: backward"),
    ("step3_optimizer", "first step: optimizer step"),
)
#: torchrun's log lines (glog style, local time): W1127 06:59:06.340000 PID file:line] ...
_TORCHRUN_LINE = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) ")


def _torchrun_times(log: str, crash: float) -> dict[str, float]:
    """When torchrun's agent noticed the failure (it sends the survivors SIGTERM, or
    reports the failure when none is left) and when it had them all stopped."""
    year = datetime.datetime.fromtimestamp(crash).year
    got: dict[str, float] = {}
    for line in log.splitlines():
        m = _TORCHRUN_LINE.match(line)
        if m is None:
            continue
        mon, day, hh, mm, ss, us = (int(x) for x in m.groups())
        t = datetime.datetime(year, mon, day, hh, mm, ss, us).timestamp() - crash
        if t < 0:
            continue
        if "closing signal" in line or "failed (exitcode" in line:
            got.setdefault("noticed", t)
        if "failed (exitcode" in line:
            got.setdefault("gone", t)
    return got


def _stalwart_times(out: Path, crash: float) -> dict[str, float]:
    """When stalwart's launcher began stopping attempt 0 and when its last worker exited;
    besides, when the kernel reported each exit (the pidfd: ``exited_at``): the killed
    rank's (``died``) and the last one's (``all_died``)."""
    got: dict[str, float] = {}
    exits: list[float] = []
    died: list[float] = []
    for f in out.glob("logs/*/events.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("attempt") != 0:
                continue
            if rec["event"] == "workers_stopping":
                got.setdefault("noticed", rec["time"] - crash)
            elif rec["event"] == "worker_exit":
                exits.append(rec["time"] - crash)
                if isinstance(rec.get("exited_at"), float):
                    died.append(rec["exited_at"] - crash)
    if exits:
        got["gone"] = max(exits)
    if died:
        got["died"], got["all_died"] = min(died), max(died)
    return got


#: stalwart's launcher rows split at the kernel's word of each exit (its pidfd): what the
#: launcher did, and what the dying processes' exit took.
SPLIT_STAGES = (
    ("died", "the killed rank's exit reported by the kernel (pidfd)", "kernel"),
    ("noticed", "failure noticed (stopping the survivors)", "launcher"),
    ("all_died", "the survivors' exit reported by the kernel", "kernel, after the SIGTERM"),
    ("gone", "old workers gone (teardown done)", "launcher"),
)


def print_split(rows: list[dict[str, Any]]) -> None:
    """stalwart's launcher rows, with the kernel's part and the launcher's part apart."""
    med = statistics.median
    print("\nstalwart's launcher rows against the kernel's word of each exit (medians):\n")
    print("| stage | at | took | whose time |\n|---|---|---|---|")
    prev = None
    for key, label, whose in SPLIT_STAGES:
        at = [r["stages"][key] for r in rows if key in r["stages"]]
        took = [
            r["stages"][key] - (r["stages"][prev] if prev else 0.0)
            for r in rows
            if key in r["stages"] and (prev is None or prev in r["stages"])
        ]
        cells = [f"{med(at):.3f}" if at else "-", f"{med(took):.3f}" if took else "-"]
        print(f"| {label} | " + " | ".join(cells) + f" | {whose} |")
        prev = key


def _job_times(out: Path, crash: float) -> tuple[dict[str, float], dict[str, float], str]:
    """The restarted job's stages (the slowest rank's time after the crash), each stage's
    CPU seconds (the most any rank spent in it), and whether torch was in the worker
    before its script ran (a warm start)."""
    at: dict[str, list[float]] = {}
    cpu: dict[int, dict[str, float]] = {}
    warm: set[bool] = set()
    for line in (out / "stages.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["attempt"] != 1:
            continue
        at.setdefault(rec["stage"], []).append(rec["t"] - crash)
        cpu.setdefault(rec["rank"], {})[rec["stage"]] = rec["cpu"]
        if rec["stage"].startswith("torch_"):
            warm.add(rec["stage"] == "torch_preimported")
    times = {k: max(v) for k, v in at.items()}
    spent: dict[str, float] = {}
    names = [k for k, _ in JOB_STAGES] + ["step4_start", "step4_optimizer"]
    for prev, name in itertools.pairwise(names):
        per_rank = [c[name] - c[prev] for c in cpu.values() if name in c and prev in c]
        if per_rank:
            spent[name] = max(per_rank)
    if "step4_start" in times and "step4_optimizer" in times:
        times["later_step"] = times["step4_optimizer"] - times["step4_start"]
        spent["later_step"] = spent.get("step4_optimizer", 0.0)
    start = "warm" if warm == {True} else "cold" if warm == {False} else "mixed"
    return times, spent, start


@dataclasses.dataclass(frozen=True)
class Failed:
    """A crash run that gave no figure; ``false_kill``: the launcher killed a rank as hung
    (the job never hangs), which the section reruns and counts."""

    why: str
    false_kill: bool = False


#: Reruns of one crash run after false kills, before the section gives up on it.
FALSE_KILL_RERUNS = 2


def _crash_once(launcher: str, ns: argparse.Namespace, out: Path) -> dict[str, Any] | Failed:
    ckpt = out / "ckpt"
    ckpt.mkdir(parents=True)
    if launcher == "torchrun":
        cmd: list[object] = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "2", "--max-restarts", "1", JOB, "plain"]
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    else:
        cmd, env = [*_stalwart(out, ns), JOB, "stalwart"], {}
    why = _launch([*cmd, out, ckpt, ns.mib, CRASH_AT], out, env)
    shutil.rmtree(ckpt, ignore_errors=True)
    hung = [
        json.loads(line)
        for f in out.glob("logs/*/events.jsonl")
        for line in f.read_text().splitlines()
        if '"hang_detected"' in line
    ]
    if hung:  # a false kill: the job has no hang
        h = hung[0]
        return Failed(
            f"{launcher}: {len(hung)} rank(s) killed as hung in attempt {h.get('attempt')} "
            f"(rank {h.get('global_rank')}, {h.get('kind')} timeout {h.get('timeout')} s, "
            f"no step for {h.get('last_heartbeat_age', 0):.1f} s; dossier {h.get('dossier')})",
            false_kill=True,
        )
    recs = _events(out)
    try:
        crash = float((out / "crash_at").read_text())
        restored = next(r for r in recs if r["kind"] == "restored")
        first = next(r for r in recs if r["kind"] == "step" and r["attempt"] == 1)
    except (OSError, ValueError, StopIteration):
        return Failed(f"{launcher}: no resumed step ({why or 'exit 0'})")
    if restored["step"] != CRASH_AT:
        return Failed(f"{launcher}: resumed from step {restored['step']}, expected {CRASH_AT}")
    log = (out / "launcher.log").read_text(errors="replace")
    ours = _torchrun_times(log, crash) if launcher == "torchrun" else _stalwart_times(out, crash)
    times, cpu, start = _job_times(out, crash)
    return {
        "restored": restored["t"] - crash,
        "first": first["t"] - crash,
        "stages": {**ours, **times},
        "cpu": cpu,
        "start": start,
    }


def crash_section(ns: argparse.Namespace, work: Path) -> int:
    """Crash -> first resumed step: plain DCP under torchrun vs stalwart's under --ckpt-ram."""
    before = _uptime()
    runs: dict[str, list[dict[str, Any]]] = {"torchrun": [], "stalwart": []}
    false_kills: list[str] = []
    for rep in range(ns.repeats):
        for launcher in runs:
            for again in range(FALSE_KILL_RERUNS + 1):
                got = _crash_once(launcher, ns, work / f"{launcher}-{rep}-{again}")
                if not isinstance(got, Failed):
                    runs[launcher].append(got)
                    break
                print(f"bench_dcp: {got.why}", file=sys.stderr)
                if not got.false_kill:
                    break
                false_kills.append(got.why)
    after = _uptime()
    if not all(runs.values()):
        return 1
    med = statistics.median
    print(
        f"\n### Crash -> first resumed step, the FSDP2 job ({3 * ns.mib / 1024:.2f} GiB of "
        f"model + AdamW, 2 ranks, a rank SIGKILLed right after step {CRASH_AT}'s save), "
        f"{ns.repeats} runs each, medians\n"
    )
    print(f"- load before: `{before}`")
    print(f"- load after: `{after}`")
    # Not hidden: a false kill is a cost of stalwart's own, counted here and rerun.
    print(f"- runs with a rank killed as hung (the job never hangs), rerun: {len(false_kills)}")
    for why in false_kills:
        print(f"  - {why}")
    print()
    base = med([r["first"] for r in runs["torchrun"]])
    print(
        "| job | crash -> restored s | crash -> first resumed step s (min / median / max) "
        "| ÷ plain DCP |"
    )
    print("|---|---|---|---|")
    names = {
        "torchrun": "torchrun, plain dcp.save / dcp.load",
        "stalwart": "stalwart run --ckpt-ram, stalwart's dcp.save / load_newest",
    }
    for launcher, rows in runs.items():
        xs = [r["first"] for r in rows]
        print(
            f"| {names[launcher]} | {med([r['restored'] for r in rows]):.2f} | "
            f"{min(xs):.2f} / {med(xs):.2f} / {max(xs):.2f} | {med(xs) / base:.2f} |"
        )
    print_breakdown(runs)
    print_split(runs["stalwart"])
    return 0


def print_breakdown(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Where the seconds went, stage by stage, medians over the runs."""
    med = statistics.median
    print(
        "\nWhere the seconds go (medians; *at*: seconds after the crash when the slowest "
        "rank got there; *took*: since the row above; *CPU*: the CPU seconds the rank that "
        "spent most used in that stage, which the host's load does not stretch):\n"
    )
    print("| stage | torchrun at | took | CPU | stalwart at | took | CPU |")
    print("|---|---|---|---|---|---|---|")
    rows = [*LAUNCHER_STAGES, *JOB_STAGES]
    for i, (key, label) in enumerate(rows):
        cells = []
        for launcher in ("torchrun", "stalwart"):
            at = [r["stages"][key] for r in runs[launcher] if key in r["stages"]]
            prev = rows[i - 1][0] if i else None
            took = [
                r["stages"][key] - r["stages"][prev]
                for r in runs[launcher]
                if prev and key in r["stages"] and prev in r["stages"]
            ]
            cpu = [r["cpu"][key] for r in runs[launcher] if key in r["cpu"]]
            cells += [
                f"{med(at):.2f}" if at else "-",
                f"{med(took):.2f}" if took else "-",
                f"{med(cpu):.2f}" if cpu else "",
            ]
        print(f"| {label} | " + " | ".join(cells) + " |")
    cells = []
    for launcher in ("torchrun", "stalwart"):
        took = [r["stages"]["later_step"] for r in runs[launcher] if "later_step" in r["stages"]]
        cpu = [r["cpu"]["later_step"] for r in runs[launcher] if "later_step" in r["cpu"]]
        cells += ["", f"{med(took):.2f}" if took else "-", f"{med(cpu):.2f}" if cpu else ""]
    print("| for comparison: the next step, whole | " + " | ".join(cells) + " |")
    # The load moves during a run: the CPU seconds from the script's start to the end of
    # the first step compare the two jobs' own work whatever the load did.
    sums = {
        launcher: med([sum(r["cpu"].get(k, 0.0) for k, _ in JOB_STAGES) for r in runs[launcher]])
        for launcher in ("torchrun", "stalwart")
    }
    print(
        f"\n- CPU seconds from the script's start to the first step done (each stage's "
        f"busiest rank, summed; median): "
        f"torchrun {sums['torchrun']:.2f}, stalwart {sums['stalwart']:.2f} "
        f"({sums['stalwart'] / max(sums['torchrun'], 1e-9):.2f}x)"
    )
    for launcher in ("torchrun", "stalwart"):
        starts = [r["start"] for r in runs[launcher]]
        print(f"\n- {launcher}'s restarted workers: " + ", ".join(starts))


if __name__ == "__main__":
    sys.exit(main())
