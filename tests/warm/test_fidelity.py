"""A worker under ``stalwart run`` (warm on its first and a restarted attempt, and
``--no-warm``) is the process it would be under torchrun: one probe program prints all
a script can observe about itself, and every difference is either listed here, with the
reason it must stay (docs/launcher.md, "What a worker sees"), or a failure."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stalwart.monitor.stacks import STACK_SIGNAL
from tests.helpers import ROOT, clean_env, stalwart, stalwart_argv

HERE = Path(__file__).parent
PROBE = HERE / "programs" / "fingerprint.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
pytestmark = pytest.mark.timeout(240)

# Per process by nature: drawn afresh by every interpreter (warm workers reseed).
RANDOM = {"torch_seed", "torch_rand", "np_rand", "py_rand", "hash"}
# Compared below with their own rules.
SPECIAL = {"environ", "argv", "orig_argv", "parent", "fds", "stdout_console", "children"}
# Ours by design, each stated in docs/launcher.md: the parent-death signal, the real-time
# signal of the stack dump, the modules the bootstrap imports (and, warm, the template's preload) with
# what importing them leaves behind (importer cache entries; torch._dynamo's loggers and
# sympy's warning filter), the frozen objects, and warm rank 0's module reporter thread.
BY_DESIGN_COLD = {"pdeathsig", "sigcgt", "modules_at_start", "sys_path_importer_cache"}
BY_DESIGN_WARM = BY_DESIGN_COLD | {
    "gc_freeze_count",
    "loggers",
    "warnings_filters",
    "tasks_at_start",
    "tasks_later",
}
# Values that name this run rather than the program's world.
RUN_NAMES = {
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_MAX_RESTARTS",
    "PROBE_OUT",
}
EXPECTED_CHILDREN = {
    "dataloader_fork": {"squares": [0, 1, 4, 9], "workers": [0, 1], "main_names": ["__main__"]},
    "dataloader_spawn": {
        "squares": [0, 1, 4, 9],
        "workers": [0, 1],
        "main_names": ["__mp_main__"],
    },
    "dataloader_forkserver": {
        "squares": [0, 1, 4, 9],
        "workers": [0, 1],
        "main_names": ["__mp_main__"],
    },
    "mp_spawn": ["__mp_main__", "__mp_main__"],
}


def _documented_env() -> str:
    return "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))


def _probe(out: Path, attempt: int, rank: int) -> dict[str, Any]:
    return json.loads((out / f"fp_{attempt}_{rank}.json").read_text())


def _compare(ref: dict[str, Any], got: dict[str, Any], by_design: set[str], what: str) -> None:
    skip = RANDOM | SPECIAL | by_design
    diffs = {k: (ref.get(k), got.get(k)) for k in set(ref) | set(got) if k not in skip}
    diffs = {k: v for k, v in diffs.items() if v[0] != v[1]}
    assert not diffs, f"{what} differs from torchrun: {json.dumps(diffs, indent=1)[:3000]}"
    # Environment: torchrun's keys are a subset of ours, our extra keys are documented,
    # and values differ only where they name this run.
    ref_env, env = ref["environ"], got["environ"]
    assert set(ref_env) <= set(env), sorted(set(ref_env) - set(env))
    docs = _documented_env()
    extra = sorted(k for k in set(env) - set(ref_env) if k != "_")
    assert all(k.startswith("STALWART_") and k in docs for k in extra), extra
    changed = {k for k in ref_env if k in env and ref_env[k] != env[k]}
    allowed = RUN_NAMES | {"_", "TORCHELASTIC_RESTART_COUNT"}
    assert changed <= allowed, {k: (ref_env[k], env[k]) for k in changed - allowed}
    assert [a for a in got["argv"] if a != "crash"] == ref["argv"]
    assert [a for a in got["orig_argv"] if a != "crash"] == ref["orig_argv"]
    assert got["stdout_console"] != "" and got["parent"]["ppid_is_1"] is False
    assert got["parent"]["parent_cmdline"][1:4] == ["-m", "stalwart.cli", "run"]
    # Beyond 0, 1, 2: the stack-dump file, in warm rank 0 the module-report pipe, and in
    # a warm worker the socket to its checkpoint writer's seed, all close-on-exec, the
    # pipe and the socket far above the numbers programs use.
    assert {k: v for k, v in ref["fds"].items() if int(k) > 2} == {}
    ours = {int(k): v for k, v in got["fds"].items() if int(k) > 2}
    stacks = [fd for fd, v in ours.items() if v.endswith("stacks.log")]
    pipes = [fd for fd, v in ours.items() if v.startswith("pipe:")]
    sockets = [fd for fd, v in ours.items() if v.startswith("socket:")]
    assert len(stacks) == 1 and set(ours) == set(stacks) | set(pipes) | set(sockets), ours
    assert len(sockets) <= 1 and all(fd >= 1000 for fd in pipes + sockets), ours
    # Caught signals: torchrun's (SIGINT) plus the stack dump's real-time one, and glibc's
    # internal one when a thread was started (warm rank 0's reporter).  SIGUSR1 stays
    # uncaught, as under torchrun.
    extra_sigs = int(got["sigcgt"], 16) & ~int(ref["sigcgt"], 16)
    assert extra_sigs & (1 << (STACK_SIGNAL - 1)), got["sigcgt"]
    assert extra_sigs & ~(1 << (STACK_SIGNAL - 1)) & ~(1 << 32) == 0, got["sigcgt"]


def test_a_worker_sees_what_it_would_see_under_torchrun(tmp_path: Path) -> None:
    outs = {m: tmp_path / m for m in ("torchrun", "warm", "cold")}
    for out in outs.values():
        out.mkdir()
    ref_run = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(PROBE), "children"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(PROBE_OUT=str(outs["torchrun"])),
        cwd=ROOT,
    )
    # Rank 1 ends with sys.exit(3) on purpose (its atexit handler must run).
    assert ref_run.returncode == 1, ref_run.stderr[-3000:]
    warm = stalwart(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--log-dir",
        tmp_path / "wlog",
        PROBE,
        "crash",
        "children",
        env=clean_env(PROBE_OUT=str(outs["warm"])),
        timeout=150,
    )
    assert warm.returncode == 1 and "exit code 3" in warm.stderr, warm.stderr[-3000:]
    cold = stalwart(
        "--no-warm",
        "--nproc-per-node",
        "2",
        "--log-dir",
        tmp_path / "clog",
        PROBE,
        "children",
        env=clean_env(PROBE_OUT=str(outs["cold"])),
        timeout=150,
    )
    assert cold.returncode == 1 and "exit code 3" in cold.stderr, cold.stderr[-3000:]
    seen_random = set()
    for rank in (0, 1):
        ref = _probe(outs["torchrun"], 0, rank)
        assert ref["children"] == EXPECTED_CHILDREN if rank == 0 else "children" not in ref
        for mode, attempt, by_design in (
            ("warm", 0, BY_DESIGN_WARM),
            ("warm", 1, BY_DESIGN_WARM),
            ("cold", 0, BY_DESIGN_COLD),
        ):
            got = _probe(outs[mode], attempt, rank)
            _compare(ref, got, by_design, f"{mode} attempt {attempt} rank {rank}")
            seen_random.add(json.dumps([got["torch_rand"], got["np_rand"], got["py_rand"]]))
            last = mode == "cold" or attempt == 1
            if rank == 0 and last:
                assert got["children"] == EXPECTED_CHILDREN, (mode, got["children"])
            if last:
                # atexit ran on a normal end (rank 0) and on sys.exit(3) (rank 1).
                assert (outs[mode] / f"atexit_{attempt}_{rank}").exists(), (mode, rank)
        assert (outs["torchrun"] / f"atexit_0_{rank}").exists()
    assert len(seen_random) == 6  # every rank of every attempt drew its own numbers


@pytest.mark.parametrize("as_module", [False, True], ids=["script", "module"])
def test_main_module_is_the_one_python_makes(tmp_path: Path, as_module: bool) -> None:
    # The script through a symbolic link: sys.path[0] is the folder of the file it points
    # to, __file__ the link's absolute path.
    link = tmp_path / "link" / "probe.py"
    link.parent.mkdir()
    link.symlink_to(HERE / "programs" / "mainprobe.py")
    target = ["-m", "tests.warm.programs.mainprobe"] if as_module else [str(link)]
    env = clean_env(PROBE_OUT=str(tmp_path), PROBE_MODE="python")
    direct = subprocess.run([sys.executable, "-u", *target], env=env, cwd=ROOT, timeout=60)
    assert direct.returncode == 0
    for mode, extra in (("warm", []), ("cold", ["--no-warm"])):
        proc = stalwart(
            "--nproc-per-node", "1", "--log-dir", tmp_path / mode, *extra, *target,
            env=clean_env(PROBE_OUT=str(tmp_path), PROBE_MODE=mode),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    want = json.loads((tmp_path / "main_python.json").read_text())
    assert want["main_at_exit"] and want["builtins_is_module"]
    assert want["path0"] == (str(ROOT) if as_module else str(HERE / "programs"))
    for mode in ("warm", "cold"):
        assert json.loads((tmp_path / f"main_{mode}.json").read_text()) == want, mode


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_a_worker_reads_the_terminal_as_under_torchrun(tmp_path: Path, mode: str) -> None:
    # torchrun's workers lead a session of their own; ours used to lead only a process
    # group in the launcher's session, a background job of the terminal: input() or
    # breakpoint() stopped the worker with SIGTTIN and the job hung.
    env = clean_env(**({} if mode == "warm" else {"STALWART_WARM": "0"}))
    argv = stalwart_argv(
        "--nproc-per-node", "1", "--shutdown-timeout", "1", "--log-dir", tmp_path,
        HERE / "programs" / "reads_tty.py",
    )  # fmt: skip
    pid, fd = pty.fork()
    if pid == 0:  # the launcher, with the terminal as its controlling one
        try:
            os.chdir(ROOT)
            os.execve(argv[0], argv, env)
        finally:
            os._exit(127)
    out = b""
    sent = False
    deadline = time.monotonic() + 90
    try:
        while b"got 'hello'" not in out and time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    out += os.read(fd, 4096)
                except OSError:  # the launcher ended: the terminal is gone
                    break
            if not sent and b"READY" in out:
                os.write(fd, b"hello\n")
                sent = True
        assert b"got 'hello'" in out, out.decode(errors="replace")[-2000:]
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        pid = 0
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)  # the guardian takes the workers with it
            os.waitpid(pid, 0)
        os.close(fd)
