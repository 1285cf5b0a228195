"""torch elastic's process-context API over stalwart's workers (issue 26 item 4, seed
001): a script without a ``__main__`` guard does not launch twice under spawn (as with
torch, the re-imported script's own launch fails in the child), a program that never
imports stalwart is run and its failure reported, bad input fails at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, alive, clean_env

# No __main__ guard: spawn re-runs this file in each child as __mp_main__.
NO_GUARD = """
import os, sys
from stalwart.compat.torch_elastic.multiprocessing import DefaultLogsSpecs, start_processes

marks = sys.argv[1]
with open(marks, "a") as fh:
    fh.write(f"top {os.getpid()}\\n")

def work(x):
    with open(marks, "a") as fh:
        fh.write(f"work {os.getpid()}\\n")
    return x

pc = start_processes(
    name="noguard", entrypoint=work, args={0: (1,), 1: (2,)}, envs={0: {}, 1: {}},
    logs_specs=DefaultLogsSpecs(log_dir=sys.argv[2]), start_method="spawn",
)
result = pc.wait(timeout=60, period=0.1)
print("failed" if result.is_failed() else "ok", sorted(result.failures), flush=True)
"""


@pytest.mark.timeout(90)
def test_script_without_main_guard_is_not_launched_twice(tmp_path: Path) -> None:
    script = tmp_path / "noguard.py"
    script.write_text(NO_GUARD)
    marks = tmp_path / "marks"
    logs = tmp_path / "logs"
    logs.mkdir()
    proc = subprocess.run(
        [sys.executable, str(script), str(marks), str(logs)],
        capture_output=True,
        text=True,
        timeout=80,
        cwd=ROOT,
        env=clean_env(),
    )
    lines = marks.read_text().splitlines()
    tops = [line for line in lines if line.startswith("top ")]
    # The launcher once, and a child re-running the file's top level, whose own
    # start_processes fails there (multiprocessing refuses to start a process while the
    # child bootstraps); the other child too unless it was stopped before it got there.
    assert 2 <= len(tops) <= 3, (lines, proc.stderr[-2000:])
    assert "bootstrapping phase" in proc.stderr, proc.stderr[-2000:]
    assert not [line for line in lines if line.startswith("work ")], lines
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The first child to fail is the result; the other was stopped with it.
    assert proc.stdout.startswith("failed ["), proc.stdout


@pytest.mark.timeout(60)
def test_program_without_stalwart_and_a_tensor_return(tmp_path: Path) -> None:
    import torch
    import torch.multiprocessing  # registers tensor sharing by handle

    from stalwart.compat.torch_elastic.multiprocessing import (
        DefaultLogsSpecs,
        Std,
        start_processes,
    )

    pc = start_processes(
        name="sh",
        entrypoint="/bin/sh",
        args={0: ("-c", "echo out-$RANK; exit 3"), 1: ("-c", "sleep 30")},
        envs={0: {"RANK": "0"}, 1: {"RANK": "1"}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL),
    )
    pids = pc.pids()
    result = pc.wait(timeout=40, period=0.05)
    assert result is not None and result.is_failed()
    assert result.failures[0].exitcode == 3
    # The other was stopped because of it, and says so, as under torch.
    assert result.failures[1].signal_name() == "SIGTERM"
    assert Path(result.stdouts[0]).read_text() == "out-0\n"
    assert not any(alive(pid) for pid in pids.values())
    # A tensor returned through torch.multiprocessing's shared memory arrives whole.
    pc = start_processes(
        name="t",
        entrypoint=torch.ones,
        args={0: (64, 64)},
        envs={0: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
        start_method="spawn",
    )
    result = pc.wait(timeout=40, period=0.05)
    assert result is not None and not result.is_failed(), result
    assert torch.equal(result.return_values[0], torch.ones(64, 64))


def test_bad_input_fails_at_once_and_starts_nothing(tmp_path: Path) -> None:
    from stalwart.compat.torch_elastic.multiprocessing import DefaultLogsSpecs, start_processes

    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(NotADirectoryError, match="expected a directory"):
        DefaultLogsSpecs(log_dir=str(a_file))
    logs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"))
    cases: list[tuple[dict[str, object], type[Exception], str]] = [
        ({"args": {0: ()}, "envs": {0: {}, 1: {}}}, RuntimeError, "envs: expected"),
        ({"args": {1: ()}, "envs": {1: {}}}, RuntimeError, "args: expected"),
        ({"numa_options": object()}, ValueError, "numa_options"),
        ({"start_method": "thread"}, ValueError, "start_method 'thread'"),
        ({"envs": {0: {"TORCHELASTIC_RESTART_COUNT": "-1"}}}, ValueError, "whole number"),
    ]
    before = set(os.listdir("/proc"))
    for overrides, error, match in cases:
        kwargs: dict[str, object] = {
            "name": "bad",
            "entrypoint": "/bin/true",
            "args": {0: ()},
            "envs": {0: {}},
            "logs_specs": logs,
        }
        kwargs.update(overrides)
        with pytest.raises(error, match=match):
            start_processes(**kwargs)  # type: ignore[arg-type]
    started = {p for p in set(os.listdir("/proc")) - before if p.isdigit()}
    assert not [p for p in started if alive(int(p)) and _parent(int(p)) == os.getpid()]


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


@pytest.mark.timeout(120)
def test_forkserver_workers_and_an_exit_without_error_file(tmp_path: Path) -> None:
    """torch's api_test subtests: function workers under forkserver run (their parent is
    the server, not the launcher), and a worker that calls sys.exit(n) fails with n and
    no error file ("<N/A>"), as under torch. The workers run builtins: nothing of
    stalwart is imported for them."""
    from stalwart.compat.torch_elastic.multiprocessing import DefaultLogsSpecs, start_processes
    from stalwart.compat.torch_elastic.multiprocessing.errors import ChildFailedError

    pc = start_processes(
        name="fs",
        entrypoint=print,
        args={0: ("hello",), 1: ("world",)},
        envs={0: {}, 1: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "fs")),
        start_method="forkserver",
    )
    result = pc.wait(timeout=90, period=0.05)
    assert result is not None
    assert not result.failures, {lr: f.exitcode for lr, f in result.failures.items()}
    assert result.return_values == {0: None, 1: None}

    pc = start_processes(
        name="exit",
        entrypoint=sys.exit,
        args={0: (138,), 1: (0,)},
        envs={0: {}, 1: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "exit")),
        start_method="spawn",
    )
    result = pc.wait(timeout=60, period=0.05)
    assert result is not None and list(result.failures) == [0]
    failure = result.failures[0]
    assert (failure.exitcode, failure.signal_name(), failure.error_file) == (138, "<N/A>", "<N/A>")
    assert failure.error_file_data == {"message": "<NONE>"}
    assert failure.message.startswith("To enable traceback see:")
    assert not list((tmp_path / "exit").rglob("error.json"))
    assert "error_file: <N/A>" in str(ChildFailedError("exit", result.failures))


# torch's function-worker body called as torch's api_test does, with one stream's
# redirect destination replaced by what a stranger could plant there; no __main__ guard.
WRAP_PLANTED = """
import os, sys
from stalwart.compat.torch_elastic.multiprocessing.api import _wrap

class Done:
    def wait(self):
        pass

class Box:
    def put(self, value):
        print("returned", value, file=sys.__stderr__, flush=True)

try:
    _wrap(0, print, {0: ("to-the-file",)}, {0: {}}, {0: sys.argv[1]}, {0: ""}, {0: Box()},
          Done())
except ValueError as exc:
    print("refused:", exc, flush=True)
"""


@pytest.mark.timeout(60)
def test_function_worker_redirect_refuses_a_planted_fifo_and_link(tmp_path: Path) -> None:
    script = tmp_path / "wrap.py"
    script.write_text(WRAP_PLANTED)
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    secret = tmp_path / "secret"
    secret.write_text("kept\n")
    link = tmp_path / "link.log"
    link.symlink_to(secret)
    regular = tmp_path / "stdout.log"
    for dest in (fifo, link, regular):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(dest)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=clean_env(),
        )
        try:
            out, err = proc.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            # The open waits for a reader: give it one so the child can end, then fail.
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
            proc.kill()
            proc.communicate()
            pytest.fail(f"the worker blocked opening {dest.name}")
        assert proc.returncode == 0, err[-2000:]
        if dest is regular:
            assert regular.read_text() == "to-the-file\n"
            assert "returned None" in err
        else:
            assert out.startswith(f"refused: redirect destination of fd 1 '{dest}'"), out
            assert out.count("\n") == 1 and "returned" not in err, (out, err)
    assert secret.read_text() == "kept\n"


@pytest.mark.timeout(60)
def test_fork_function_workers_return_and_have_exited_when_wait_returns(tmp_path: Path) -> None:
    """torch's start_method="fork": the workers' return values arrive and, when wait()
    returns, every worker process has exited (torch's api_test checks the latter through
    its internals). The entrypoint is a builtin: nothing of stalwart is imported for it."""
    from stalwart.compat.torch_elastic.multiprocessing import DefaultLogsSpecs, start_processes

    pc = start_processes(
        name="fork",
        entrypoint=os.getpid,
        args={0: (), 1: ()},
        envs={0: {}, 1: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
        start_method="fork",
    )
    pids = pc.pids()
    result = pc.wait(timeout=30, period=0.05)
    assert result is not None, "the fork workers never ended"
    assert not result.failures and result.return_values == pids
    assert not any(alive(pid) for pid in pids.values())
