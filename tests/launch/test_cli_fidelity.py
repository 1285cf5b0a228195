"""Side by side: the same command line through ``torchrun`` and ``stalwart run``.

What a user sees is compared: which flags are taken and what they mean, the workers'
environment, the console (prefixes, ``-r``/``-t`` maps, ``--local-ranks-filter``, the
``OMP_NUM_THREADS`` warning), the ``--log-dir`` tree, ``error.json`` and the launcher's
exit code.  The differences that are stalwart's on purpose are asserted as such (and
listed in docs/migrating.md), so a change on either side shows here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from stalwart.cli import build_config, run_parser
from stalwart.config import ConfigError, Std
from stalwart.launch.workers.environment import virtual_local_rank
from tests.helpers import clean_env, stalwart_argv, wait_for

from .helpers import SCRIPTS

pytestmark = pytest.mark.timeout(120)

PROBE = SCRIPTS / "fid_probe.py"
OMP_LINE = "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default"


def _options(parser: object) -> set[str]:
    return set(parser._option_string_actions)  # type: ignore[attr-defined]


def test_every_torchrun_option_is_known() -> None:
    """Every spelling torchrun 2.13's parser has is one of ours (taken or refused with
    a reason of its own, never 'unrecognized arguments')."""
    missing = sorted(_options(get_args_parser()) - _options(run_parser()))
    assert not missing, missing


# argv (before the script) -> what it must set, as torchrun means it
_SAME_MEANING = [
    (["--nproc_per_node", "3"], "nproc_per_node", 3),
    (["--nproc-per-node", "cpu"], "nproc_per_node", len(os.sched_getaffinity(0))),
    (["--nproc-per-node", "auto"], "nproc_per_node", len(os.sched_getaffinity(0))),
    (["--nnodes", "1:2", "--rdzv_backend", "c10d"], "node_range", (1, 2)),
    (["--rdzv_id", "job1"], "run_id", "job1"),
    (["--max_restarts", "4"], "max_restarts", 4),
    (["--monitor_interval", "0.5"], "monitor_interval", 0.5),
    (["--start_method", "fork"], "start_method", "fork"),
    (["--role", "trainer"], "role", "trainer"),
    (["--log_dir", "/tmp"], "log_dir", Path("/tmp")),
    (["--local_ranks_filter", "0"], "local_ranks_filter", {0}),
    (["--master_addr", "10.0.0.1"], "master_addr", "10.0.0.1"),
    (["--master_port", "1234"], "master_port", 1234),
    (["--local_addr", "10.0.0.2"], "local_addr", "10.0.0.2"),
    (["--shutdown_timeout", "5"], "shutdown_timeout", 5.0),
    (["--signals_to_handle", "SIGTERM,SIGUSR1"], "signals_to_handle", ("SIGTERM", "SIGUSR1")),
    (["--event_log_handler", "console"], "event_log_handler", "console"),
    (["--logs_specs", "default"], "logs_specs", "default"),
    (["--duplicate_stdout_filters", ""], "duplicate_stdout_filters", []),
    (["--virtual_local_rank"], "virtual_local_rank", True),
    (["--run_path"], "run_path", True),
    (["--no_python"], "no_python", True),
]


@pytest.mark.parametrize(("argv", "field", "want"), _SAME_MEANING)
def test_torchrun_flag_same_meaning(
    argv: list[str], field: str, want: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    entry = "true" if "--no_python" in argv else "x.py"
    cfg, _ = build_config([*argv, entry])
    assert getattr(cfg, field) == want


# torchrun flags stalwart cannot honour: refused with one line naming value and reason
_REFUSED = [
    (["--numa-binding", "node"], "--numa-binding 'node': not supported"),
    (["--logs-specs", "mine"], "--logs-specs 'mine': expected default"),
    (["--duplicate-stdout-filters", "loss,acc"], "--duplicate-stdout-filters ['loss', 'acc']"),
    (["--duplicate-stderr-filters", "x"], "--duplicate-stderr-filters ['x']"),
    (["--event-log-handler", "kafka"], "--event-log-handler 'kafka': expected one of null"),
    (["--signals-to-handle", "SIGTERM,SIGNOPE"], "'SIGNOPE' is not a signal name"),
    (["--signals-to-handle", "SIGKILL"], "SIGKILL cannot be handled"),
    (["--nproc-per-node", "xpu"], "--nproc-per-node xpu: no XPU device"),
]


@pytest.mark.parametrize(("argv", "needle"), _REFUSED)
def test_torchrun_flag_refused_with_one_line(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config([*argv, "x.py"])
    assert "\n" not in str(info.value) and needle in str(info.value)


def test_virtual_local_rank_needs_a_gpu_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError, match="names fewer GPUs than workers"):
        build_config(["--virtual-local-rank", "--nproc-per-node", "2", "x.py"])


def test_torchruns_shutdown_timeout_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "12")
    assert build_config(["x.py"])[0].shutdown_timeout == 12.0
    assert build_config(["--shutdown-timeout", "3", "x.py"])[0].shutdown_timeout == 3.0


# -- the same command line through both launchers ------------------------------------------


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    attempts: Path | None  # the folder holding attempt_<n>/
    env: dict[int, dict[str, str]]


def _launch(tmp: Path, launcher: str, mode: str, *flags: str, stop: int = 0) -> Run:
    env = clean_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)  # --virtual-local-rank picks from it when set
    out, logs = tmp / launcher / "out", tmp / launcher / "logs"
    out.mkdir(parents=True)
    head = (
        [sys.executable, "-m", "torch.distributed.run"]
        if launcher == "torchrun"
        else stalwart_argv()
    )
    argv = [*head, *flags, "--log-dir", str(logs), str(PROBE), mode, str(out)]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    if stop:

        def started() -> bool:
            assert proc.poll() is None, f"{launcher} exited before its workers started"
            return len(list(out.glob("ready_*"))) >= 2

        wait_for(started, 60, "both workers to start", 0.05)
        proc.send_signal(stop)
    stdout, stderr = proc.communicate(timeout=90)
    runs = [p.parent for p in logs.glob("*/attempt_0")]
    env = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("env_*.json")}
    return Run(proc.returncode, stdout, stderr, runs[0] if runs else None, env)


def side_by_side(tmp: Path, mode: str, *flags: str, stop: int = 0) -> tuple[Run, Run]:
    """(torchrun's run, stalwart's run) of ``fid_probe.py MODE`` with *flags*."""
    return _launch(tmp, "torchrun", mode, *flags, stop=stop), _launch(
        tmp, "stalwart", mode, *flags, stop=stop
    )


def _tree(run: Run) -> set[str]:
    if run.attempts is None:
        return set()
    return {
        str(p.relative_to(run.attempts))
        for p in run.attempts.rglob("*")
        if p.is_file() and p.parts[len(run.attempts.parts)].startswith("attempt_")
    }


def _worker_lines(text: str) -> list[str]:
    """The lines the workers wrote, as the console shows them (launcher chatter out)."""
    return sorted(ln for ln in text.splitlines() if re.search(r"(out|err) of rank \d", ln))


@pytest.mark.slow
def test_same_console_env_and_files(tmp_path: Path) -> None:
    theirs, ours = side_by_side(
        tmp_path,
        "ok",
        "--nproc_per_node",
        "2",
        "-t",
        "0:3,1:1",
        "--role",
        "trainer",
        "--signals-to-handle",
        "SIGTERM,SIGINT,SIGUSR1",
        "--virtual-local-rank",
    )
    assert theirs.code == ours.code == 0, ours.stderr
    assert _worker_lines(ours.stdout) == _worker_lines(theirs.stdout)
    assert _worker_lines(ours.stderr) == _worker_lines(theirs.stderr)
    assert "[trainer0]:out of rank 0" in ours.stdout  # torchrun's prefix: role, local rank
    assert OMP_LINE in theirs.stderr and OMP_LINE in ours.stderr
    assert (
        _tree(ours)
        == _tree(theirs)
        == {
            "attempt_0/0/stdout.log",
            "attempt_0/0/stderr.log",
            "attempt_0/1/stdout.log",
        }
    )
    assert set(ours.env) == set(theirs.env) == {0, 1}
    for rank in (0, 1):
        a, b = dict(ours.env[rank]), dict(theirs.env[rank])
        for key in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"):
            assert a.pop(key) and b.pop(key)  # the run's own id and folder
        assert a == b
        assert a["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGUSR1"
        assert a["LOCAL_RANK"] == "0" and a["CUDA_VISIBLE_DEVICES"] == str(rank)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_same_exit_code_and_error_file_for_a_failed_worker(tmp_path: Path, mode: str) -> None:
    theirs, ours = side_by_side(tmp_path, mode, "--standalone", "--nproc-per-node", "2")
    assert theirs.code == ours.code == 1, ours.stderr
    assert "FAILED" in theirs.stderr and "FAILED" in ours.stderr
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", theirs.stderr)
    assert "root cause: rank 1 (node 0, local rank 1" in ours.stderr
    if mode == "kill":
        assert "SIGKILL" in theirs.stderr and "signal SIGKILL" in ours.stderr
        return
    assert theirs.attempts is not None and ours.attempts is not None
    a = json.loads((ours.attempts / "attempt_0/1/error.json").read_text())["message"]
    b = json.loads((theirs.attempts / "attempt_0/1/error.json").read_text())["message"]
    assert set(b) <= set(a) and set(b["extraInfo"]) <= set(a["extraInfo"])
    assert "ValueError: boom from rank 1" in a["message"] and a["message"] == b["message"]
    assert "ValueError: boom from rank 1" in ours.stderr


@pytest.mark.slow
def test_same_exit_code_when_restarts_run_out(tmp_path: Path) -> None:
    theirs, ours = side_by_side(tmp_path, "exit3", "--nproc-per-node", "2", "--max-restarts", "1")
    assert theirs.code == ours.code == 1, ours.stderr
    for run in (theirs, ours):  # two attempts each: the first and one restart
        assert run.stdout.count("out of rank 1") == 2, run.stdout
        assert run.env[1]["TORCHELASTIC_RESTART_COUNT"] == "1"  # the last attempt's
        assert run.env[1]["TORCHELASTIC_MAX_RESTARTS"] == "1"
    assert "exit code 3" in ours.stderr and re.search(r"exitcode\s*: 3 ", theirs.stderr)


@pytest.mark.slow
def test_signal_to_the_launcher_exit_code(tmp_path: Path) -> None:
    """A documented difference: torchrun ends with its ``SignalException`` traceback and
    exit code 1; stalwart stops the workers the same way and exits 128 + the signal, the
    shell's convention, so a scheduler can tell 'stopped' from 'failed'."""
    flags = ("--nproc-per-node", "2", "-t", "3", "--local-ranks-filter", "1")
    theirs, ours = side_by_side(tmp_path, "wait", *flags, stop=signal.SIGTERM)
    assert theirs.code == 1 and "SignalException" in theirs.stderr
    assert ours.code == 128 + signal.SIGTERM and "Traceback" not in ours.stderr
    # the filter: only local rank 1 on the console, every rank in the files
    assert (
        _worker_lines(ours.stdout) == _worker_lines(theirs.stdout) == ["[default1]:out of rank 1"]
    )
    assert _worker_lines(ours.stderr) == _worker_lines(theirs.stderr)
    assert _tree(ours) == _tree(theirs)


@pytest.mark.slow
def test_signals_to_handle_forwards_an_extra_signal(tmp_path: Path) -> None:
    """``--signals-to-handle ...,SIGUSR1``: the launcher forwards SIGUSR1 to the workers
    (which catch it and end) and stops, as torchrun does with that flag."""
    flags = ("--nproc-per-node", "2", "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1")
    ours = _launch(tmp_path, "stalwart", "wait", *flags, stop=signal.SIGUSR1)
    out = tmp_path / "stalwart" / "out"
    assert {p.name for p in out.glob("usr1_*")} == {"usr1_0", "usr1_1"}, ours.stderr
    assert ours.code == 128 + signal.SIGUSR1, ours.stderr
    assert ours.env[0]["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGUSR1"


@pytest.mark.slow
def test_a_forwarded_sigusr1_ends_a_worker_without_a_handler_at_once(tmp_path: Path) -> None:
    """As under torchrun, a worker with no SIGUSR1 handler of its own dies of the forwarded
    signal at once, instead of (with a stack dump on SIGUSR1) sleeping through the grace
    period until the launcher's SIGKILL."""
    flags = ("--nproc-per-node", "2", "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1")
    ours = _launch(tmp_path, "stalwart", "bare_wait", *flags, stop=signal.SIGUSR1)
    assert ours.code == 128 + signal.SIGUSR1, ours.stderr
    assert ours.attempts is not None
    exits = [
        json.loads(line)
        for line in (ours.attempts / "events.jsonl").read_text().splitlines()
        if '"worker_exit"' in line
    ]
    assert sorted(e["signal"] for e in exits) == ["SIGUSR1", "SIGUSR1"], exits


# torchrun's PET_<FLAG> variables: each flag's default, as torchrun reads them
_PET = [
    ({"PET_TEE": "3"}, "tee", Std.ALL),
    ({"PET_ROLE": "trainer"}, "role", "trainer"),
    ({"PET_MONITOR_INTERVAL": "2"}, "monitor_interval", 2.0),
    ({"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGUSR2"}, "signals_to_handle", ("SIGTERM", "SIGUSR2")),
    ({"PET_SHUTDOWN_TIMEOUT": "4"}, "shutdown_timeout", 4.0),
    ({"PET_MODULE": "1"}, "module", True),
    ({"PET_MODULE": "0"}, "module", False),
    ({"PET_STANDALONE": "1"}, "rdzv_backend", "c10d"),
    ({"PET_STANDALONE": "0"}, "rdzv_backend", "static"),
]


@pytest.mark.parametrize(("env", "field", "want"), _PET)
def test_torchruns_pet_variables(
    env: dict[str, str], field: str, want: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert getattr(build_config(["x.py"])[0], field) == want


def test_a_flag_beats_its_pet_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_ROLE", "trainer")
    assert build_config(["--role", "eval", "x.py"])[0].role == "eval"


@pytest.mark.parametrize(
    ("local_rank", "visible", "want"),
    [(1, None, "1"), (1, "4,6", "6"), (0, " 5 ,7", "5")],
)
def test_virtual_local_rank_picks_the_workers_gpu(
    local_rank: int, visible: str | None, want: str
) -> None:
    env = virtual_local_rank(local_rank, visible)
    assert env == {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": want}
