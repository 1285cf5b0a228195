"""Sharded checkpoints: an FSDP2 model + AdamW on 2 gloo ranks, DCP vs stalwart's DCP path.

    .venv/bin/python bench/bench_dcp.py [--mib 384] [--repeats 3] [--markdown]
        [--sections save,restore,crash]   (as root: it drops the page cache)

Measured in the same two processes, interleaved, per repeat:
  - stall (the save call returns) and durable (the step is on disk, fsync'd) for
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
    ``stalwart run --ckpt-ram``.
``--sections`` picks them (default: save,restore,crash).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# "stalwart": shards written by the writer subprocess from shared memory (the default);
# "stalwart (in-rank writes)": by DCP's thread in the rank, as before.
SAVES = ("dcp default", "dcp async stager", "stalwart", "stalwart (in-rank writes)", "plain write")
ROOT = HERE.parent
JOB = HERE / "dcp_crash_job.py"
SECTIONS = ("save", "restore", "crash")
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
    from stalwart.checkpoint.process_args import WriterProcessConfig

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
        writer_config=WriterProcessConfig(init_timeout_s=600.0),
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
                stall = time.perf_counter() - t0
                fut.result()
            elif method == "dcp async stager":
                resp = dcp.async_save(
                    state,
                    checkpoint_id=work / f"astager-{rep}",
                    process_group=ckpt_group,
                    async_stager=async_stager,
                )
                stall = time.perf_counter() - t0
                resp.upload_completion.result()  # type: ignore[union-attr]
            elif method.startswith("stalwart"):
                chosen = saver if method == "stalwart" else thread_saver
                _staged, done = chosen.save(state, rep + 1)
                stall = time.perf_counter() - t0
                done.result()
            else:
                out = work / f"raw-{rep}-{rank}"
                with open(out, "wb") as f:
                    for t in [*m.values(), *[v for s in o["state"].values() for v in s.values()]]:
                        if hasattr(t, "to_local"):
                            f.write(memoryview(t.to_local().contiguous().view(torch.uint8).numpy()))
                    f.flush()
                    os.fsync(f.fileno())
                stall = time.perf_counter() - t0
            durable = time.perf_counter() - t0
            dist.barrier()
            emit(kind="save", method=method, rep=rep, stall=stall, durable=durable)
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
    ap.add_argument("--sections", default=",".join(SECTIONS), help="save,restore,crash")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
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
    for name, fn in (("restore", restore_section), ("crash", crash_section)):
        if name in sections:
            work = Path(tempfile.mkdtemp(prefix=f"stalwart-bench-dcp-{name}-"))
            try:
                rc = fn(ns, work) or rc
            finally:
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
    print("| save | stall s | durable s | durable ÷ plain write | stall ÷ DCP async stager |")
    print("|---|---|---|---|---|")
    for method in SAVES:
        rows = [r for r in saves if r["method"] == method]
        stall, durable = med([r["stall"] for r in rows]), med([r["durable"] for r in rows])
        print(
            f"| {method} | {stall:.3f} | {durable:.3f} | {durable / plain:.2f} | "
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


def _crash_once(launcher: str, ns: argparse.Namespace, out: Path) -> dict[str, float] | str:
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
    recs = _events(out)
    try:
        crash = float((out / "crash_at").read_text())
        restored = next(r for r in recs if r["kind"] == "restored")
        first = next(r for r in recs if r["kind"] == "step" and r["attempt"] == 1)
    except (OSError, ValueError, StopIteration):
        return f"{launcher}: no resumed step ({why or 'exit 0'})"
    if restored["step"] != CRASH_AT:
        return f"{launcher}: resumed from step {restored['step']}, expected {CRASH_AT}"
    hung = [
        line
        for f in out.glob("logs/*/events.jsonl")
        for line in f.read_text().splitlines()
        if '"hang_detected"' in line
    ]
    if hung:  # a false kill: the job has no hang
        return f"{launcher}: {len(hung)} rank(s) killed as hung: {hung[0][:300]}"
    return {"restored": restored["t"] - crash, "first": first["t"] - crash}


def crash_section(ns: argparse.Namespace, work: Path) -> int:
    """Crash -> first resumed step: plain DCP under torchrun vs stalwart's under --ckpt-ram."""
    before = _uptime()
    runs: dict[str, list[dict[str, float]]] = {"torchrun": [], "stalwart": []}
    for rep in range(ns.repeats):
        for launcher in runs:
            got = _crash_once(launcher, ns, work / f"{launcher}-{rep}")
            if isinstance(got, str):
                print(f"bench_dcp: {got}", file=sys.stderr)
            else:
                runs[launcher].append(got)
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
    print(f"- load after: `{after}`\n")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
