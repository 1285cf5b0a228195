"""A worker whose program failed runs the shutdown a program can see (threading's
callbacks and threads, atexit handlers, flushed files), then exits without the
interpreter's teardown, which for a rank holding a large heap took seconds before the
launcher could restart the job (issue 24 item 4)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stalwart.launch.workers.exiting import ExitStatus, exit_status
from tests.helpers import ROOT, clean_env, events, stalwart

HERE = Path(__file__).parent
pytestmark = pytest.mark.timeout(120)

#: The crasher's leftover object frees itself in 60 s: a worker still alive this long
#: after the fault ran the interpreter's teardown.
PROMPT_S = 30


def _assert_shut_down(out: Path, stdout: str) -> None:
    # threading's shutdown ran first: the pool's queued tasks and the non-daemon thread
    # were done when the atexit handler looked.
    assert (out / "atexit_saw").read_text() == "task_0,task_1,task_2,thread_done"
    assert (out / "unflushed.txt").read_text() == "written before the crash\n"
    assert "from C before the crash" in stdout


@pytest.mark.parametrize(
    ("how", "code", "says"),
    [
        ("raise", 1, "RuntimeError: crashing on purpose"),
        ("exit", 1, "exiting on purpose"),
        ("interrupt", -signal.SIGINT, "KeyboardInterrupt"),
    ],
)
def test_a_failed_program_shuts_down_and_exits_without_the_teardown(
    tmp_path: Path, how: str, code: int, says: str
) -> None:
    # What a cold worker runs; the program never imports stalwart and has no guard.
    out = tmp_path / "out"
    out.mkdir()
    error_file = tmp_path / "error.json"
    env = clean_env(TORCHELASTIC_ERROR_FILE=str(error_file))
    argv = [sys.executable, "-u", "-m", "stalwart.launch.workers.bootstrap"]
    proc = subprocess.run(
        [*argv, str(HERE / "crasher.py"), str(out), how],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=PROMPT_S + 10,
    )
    ended = time.time()
    assert proc.returncode == code, proc.stderr[-3000:]
    assert says in proc.stderr
    _assert_shut_down(out, proc.stdout)
    assert ended - float((out / "fault").read_text()) < PROMPT_S
    assert says in json.dumps(json.loads(error_file.read_text()))


def test_a_crashed_warm_worker_exits_promptly_with_its_error_file(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    proc = stalwart(
        "--nproc-per-node", "1", "--max-restarts", "0", "--log-dir", logs,
        HERE / "crasher.py", out, "raise",
        env=clean_env(), timeout=100,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    _assert_shut_down(out, proc.stdout)
    exits = [e for e in events(logs) if e["event"] == "worker_exit"]
    assert [e["exitcode"] for e in exits] == [1]
    assert float(exits[0]["exited_at"]) - float((out / "fault").read_text()) < PROMPT_S
    error = json.loads(next(logs.glob("*/attempt_0/0/error.json")).read_text())
    assert "crashing on purpose" in json.dumps(error)


def test_a_shutdown_that_never_ends_is_cut_at_the_bound(tmp_path: Path) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(
        textwrap.dedent(
            """
            import threading
            from stalwart.launch.workers import exiting

            threading.Thread(target=threading.Event().wait, name="never-ends").start()
            exiting.shut_down_and_exit(3, bound_s=0.5)
            """
        )
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 3, proc.stderr
    assert "non-daemon threads left: never-ends" in proc.stderr
    assert time.monotonic() - t0 < 30


# What `python -c "import sys; sys.exit(CODE)"` exits with and prints, checked against
# this interpreter below; a hostile code (huge, unprintable, a 1 MiB text) included.
_HUGE = "x" * (1 << 20)
EXIT_CODES: list[tuple[str, ExitStatus]] = [
    ("None", ExitStatus(0)),
    ("3", ExitStatus(3)),
    ("True", ExitStatus(1)),
    ("256", ExitStatus(0)),
    ("-1", ExitStatus(255)),
    ("2**31 + 5", ExitStatus(5)),
    ("2**63 - 1", ExitStatus(255)),
    ("2**63", ExitStatus(255)),
    ("-(2**63) - 1", ExitStatus(255)),
    ("10**100", ExitStatus(255)),
    ("'a message'", ExitStatus(1, "a message")),
    ("3.5", ExitStatus(1, "3.5")),
    ("['x']", ExitStatus(1, "['x']")),
    ("type('B', (), {'__str__': lambda s: 1 / 0})()", ExitStatus(1, "")),
    ("'x' * (1 << 20)", ExitStatus(1, _HUGE)),
]


@pytest.mark.parametrize(("expr", "expected"), EXIT_CODES)
def test_exit_status_reads_a_code_as_the_interpreter(expr: str, expected: ExitStatus) -> None:
    assert exit_status(eval(expr)) == expected
    real = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.exit({expr})"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert real.returncode == expected.status
    assert real.stderr == ("" if expected.message is None else expected.message + "\n")
