"""The original tools' own test suites, run against the original and against stalwart
with only their import lines rewritten (issue 26 item 5).

    .venv/bin/python bench/upstream_suites.py \\
        --nvidia /path/to/nvidia-resiliency-ext   # a git clone (tags v0.2.1, v0.4.1)
        --pytorch /path/to/pytorch                # a checkout (or just its test/ files)
        --ref-python 0.2.1=/venv021/bin/python --ref-python 0.4.1=/venv041/bin/python
        [--ref-python torch=/venv/bin/python] [--only SUBSTRING] [--keep DIR]

A reference interpreter is one with the original package installed (e.g.
`pip install -c constraints.txt nvidia-resiliency-ext==0.4.1 pytest pytest-timeout
expecttest`); stalwart's rows run with this interpreter. A suite whose reference
interpreter is not given shows "-" in that column. Nothing of the upstream suites is
kept: each run copies them into a temporary folder (or `--keep DIR`), rewrites the
import lines there, runs pytest per side and counts its outcomes: tests from pytest's
per-test lines, and unittest `subTest`s (pytest >= 9 reports each one) through a small
plugin of this script's that writes one line per subtest report. A test whose subtests
fail still reads PASSED on its own line, so the subtest counts are the finer measure.
The tests and subtests that pass under the original and fail under stalwart are listed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# Import lines only: a line that starts (after indentation) with `import` or `from`.
_IMPORT_LINE = re.compile(r"^(\s*)(import|from)\s")

NVIDIA_MODULES = (
    # ft_launcher's parser is a compat module: `stalwart run` takes no --ft-* options.
    ("nvidia_resiliency_ext.fault_tolerance.launcher", "stalwart.compat.ft_launcher"),
    ("nvidia_resiliency_ext.inprocess", "stalwart.inprocess"),
    ("nvidia_resiliency_ext.fault_tolerance", "stalwart.monitor"),
)

# torch modules and stalwart's equivalents (the more specific path first).
TORCH_MODULES = (("torch.distributed.elastic", "stalwart.compat.torch_elastic"),)


def rewrite_module_paths(text: str, pairs: tuple[tuple[str, str], ...]) -> str:
    """Replace module paths on import lines only, leaving every other line as it is."""
    out: list[str] = []
    for line in text.splitlines(keepends=True):
        if _IMPORT_LINE.match(line):
            for old, new in pairs:
                line = line.replace(old, new)
        out.append(line)
    return "".join(out)


def rewrite_torch(text: str) -> str:
    """Import lines, and the dotted names that `mock.patch("torch.distributed...")` imports
    by string (a patch target is an import too: left alone it would patch torch's module,
    not the one under test)."""
    text = rewrite_module_paths(text, TORCH_MODULES)
    for old, new in TORCH_MODULES:
        text = re.sub(r"""(["'])""" + re.escape(old) + r"\b", r"\g<1>" + new, text)
    return text


def rewrite_torch_patching_processes(text: str) -> str:
    """As `rewrite_torch`, but a `mock.patch` of a global of torch's
    `multiprocessing.api` (its `signal`, `threading`, `logger`) targets the module whose
    code reads it: the compat module only re-exports `PContext`."""
    text = re.sub(
        r"""(["'])torch\.distributed\.elastic\.multiprocessing\.api\.""",
        r"\g<1>stalwart.launch.workers.torch_processes.",
        text,
    )
    return rewrite_torch(text)


def rewrite_nvidia_fault_tolerance_from(text: str) -> str:
    """`from nvidia_resiliency_ext import fault_tolerance` names the package by attribute;
    the stalwart spelling imports the module under the same local name."""
    text = re.sub(
        r"^(\s*)from nvidia_resiliency_ext import fault_tolerance\s*$",
        r"\1import stalwart.monitor as fault_tolerance",
        text,
        flags=re.M,
    )
    text = re.sub(
        r"^(\s*)from nvidia_resiliency_ext import inprocess\s*$",
        r"\1import stalwart.inprocess as inprocess",
        text,
        flags=re.M,
    )
    return rewrite_module_paths(text, NVIDIA_MODULES)


def override_after_imports(extra: str) -> Callable[[str], str]:
    """Add import lines after the module's first import block, so that names the test
    imported from torch are rebound to stalwart's (the test body stays untouched)."""

    def rewrite(text: str) -> str:
        lines = text.splitlines(keepends=True)
        last = 0
        depth = 0
        for i, line in enumerate(lines):
            if depth == 0 and line.startswith(("import ", "from ")):
                last = i
            if depth or line.startswith(("import ", "from ")):
                depth += line.count("(") - line.count(")")
                if depth == 0:
                    last = i
            if line.startswith(("def ", "class ", "@")):
                break
        lines.insert(last + 1, extra + "\n")
        return "".join(lines)

    return rewrite


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    source: str  # "nvidia@<tag>" or "pytorch"
    paths: tuple[str, ...]  # copied from the source; the first entries are pytest targets
    targets: tuple[str, ...]
    rewrite: Callable[[str], str]
    ref: str  # key of --ref-python
    ignore: tuple[str, ...] = ()
    timeout_s: int = 60


SUITES = (
    Suite(
        "NVIDIA 0.2.1 tests/inprocess",
        "nvidia@v0.2.1",
        ("tests",),
        ("tests/inprocess",),
        rewrite_nvidia_fault_tolerance_from,
        "0.2.1",
        ignore=("tests/inprocess/test_app.py", "tests/inprocess/test_torch.py"),
    ),
    Suite(
        "NVIDIA 0.4.1 tests/inprocess",
        "nvidia@v0.4.1",
        ("tests",),
        ("tests/inprocess",),
        rewrite_nvidia_fault_tolerance_from,
        "0.4.1",
        ignore=(
            "tests/inprocess/test_app.py",
            "tests/inprocess/test_torch.py",
            "tests/inprocess/test_nested_restarter.py",
        ),
    ),
    Suite(
        "NVIDIA 0.4.1 fault_tolerance client/timeouts/state",
        "nvidia@v0.4.1",
        ("tests",),
        (
            "tests/fault_tolerance/unit/test_timeouts_calc.py",
            "tests/fault_tolerance/unit/test_timeouts.py",
            "tests/fault_tolerance/unit/test_timeouts_sections.py",
            "tests/fault_tolerance/unit/test_init.py",
            "tests/fault_tolerance/unit/test_reconnect.py",
        ),
        rewrite_nvidia_fault_tolerance_from,
        "0.4.1",
        timeout_s=240,  # NVIDIA's own wait up to 180 s for their rank processes
    ),
    Suite(
        "NVIDIA 0.4.1 fault_tolerance config",
        "nvidia@v0.4.1",
        ("tests",),
        ("tests/fault_tolerance/unit/test_config.py",),
        rewrite_nvidia_fault_tolerance_from,
        "0.4.1",
    ),
    Suite(
        "torch test_checkpoint_process.py",
        "pytorch",
        ("test/distributed/checkpoint/_experimental/test_checkpoint_process.py",),
        ("test/distributed/checkpoint/_experimental/test_checkpoint_process.py",),
        override_after_imports(
            "from stalwart.checkpoint import CheckpointProcess, CheckpointProcessConfig"
        ),
        "torch",
    ),
    Suite(
        "torch elastic/multiprocessing/errors",
        "pytorch",
        ("test/distributed/elastic/multiprocessing/errors",),
        ("test/distributed/elastic/multiprocessing/errors",),
        rewrite_torch,
        "torch",
    ),
    Suite(
        "torch elastic/multiprocessing api_test.py",
        "pytorch",
        (
            "test/distributed/elastic/multiprocessing/api_test.py",
            "test/distributed/elastic/multiprocessing/bin",
        ),
        ("test/distributed/elastic/multiprocessing/api_test.py",),
        rewrite_torch,
        "torch",
        timeout_s=120,
    ),
    Suite(
        "torch elastic/multiprocessing redirects_test.py",
        "pytorch",
        ("test/distributed/elastic/multiprocessing/redirects_test.py",),
        ("test/distributed/elastic/multiprocessing/redirects_test.py",),
        rewrite_torch,
        "torch",
    ),
    Suite(
        "torch elastic/multiprocessing tail_log_test.py",
        "pytorch",
        ("test/distributed/elastic/multiprocessing/tail_log_test.py",),
        ("test/distributed/elastic/multiprocessing/tail_log_test.py",),
        rewrite_torch,
        "torch",
    ),
    Suite(
        "torch elastic/timer file_based_local_timer_test.py",
        "pytorch",
        ("test/distributed/elastic/timer/file_based_local_timer_test.py",),
        ("test/distributed/elastic/timer/file_based_local_timer_test.py",),
        rewrite_torch,
        "torch",
    ),
    # torch's timer API (TimerServer's watchdog round over a RequestQueue) and the
    # multiprocessing-queue timers; torch 2.13's PContext.start signal handling.
    Suite(
        "torch elastic/timer api_test.py",
        "pytorch",
        ("test/distributed/elastic/timer/api_test.py",),
        ("test/distributed/elastic/timer/api_test.py",),
        rewrite_torch,
        "torch",
    ),
    Suite(
        "torch elastic/timer local_timer_test.py",
        "pytorch",
        ("test/distributed/elastic/timer/local_timer_test.py",),
        ("test/distributed/elastic/timer/local_timer_test.py",),
        rewrite_torch,
        "torch",
    ),
    Suite(
        "torch elastic/multiprocessing test_api.py (signals)",
        "pytorch",
        ("test/distributed/elastic/multiprocessing/test_api.py",),
        ("test/distributed/elastic/multiprocessing/test_api.py",),
        rewrite_torch_patching_processes,
        "torch",
    ),
)


def _count(outcomes: dict[str, str]) -> str:
    kinds = list(outcomes.values())
    return (
        f"{kinds.count('passed')} passed, {kinds.count('failed')} failed, "
        f"{kinds.count('skipped')} skipped"
    )


@dataclasses.dataclass(frozen=True)
class Outcome:
    """Per test (and per subtest, "<test> <description>"): passed, failed or skipped."""

    tests: dict[str, str]
    subtests: dict[str, str]
    seconds: float

    def cell(self) -> str:
        if not self.tests:
            return "none collected (import error)"
        return _count(self.tests)

    def subtest_cell(self) -> str:
        return _count(self.subtests) if self.subtests else "none"


def regressions(original: Outcome, ours: Outcome) -> list[str]:
    """Tests and subtests that pass under the original and do not under stalwart."""
    lost = [
        name
        for table, theirs in ((ours.tests, original.tests), (ours.subtests, original.subtests))
        for name, kind in theirs.items()
        if kind == "passed" and table.get(name, "failed") != "passed"
    ]
    return sorted(lost)


# Loaded into pytest with `-p`: one JSON line per subtest report, written as it comes so
# that a suite that kills its own pytest still counts what ran. Written by this script
# into the run's temporary folder (nothing upstream).
_SUBTEST_PLUGIN = """\
import json, os

def pytest_runtest_logreport(report):
    context = getattr(report, "context", None)
    if context is None or report.when != "call":
        return
    kwargs = getattr(context, "kwargs", {}) or {}
    label = " ".join(
        ([f"[{context.msg}]"] if getattr(context, "msg", None) is not None else [])
        + [f"{k}={v}" for k, v in kwargs.items()]
    )
    line = json.dumps({"test": report.nodeid, "subtest": label, "outcome": report.outcome})
    with open(os.environ["STALWART_UPSTREAM_SUBTESTS"], "a") as out:
        out.write(line + "\\n")
"""
_SUBTEST_PLUGIN_NAME = "stalwart_upstream_subtests"
# A subtest's label names its parameters; a temporary path among them differs per run.
_TEMP_PATH = re.compile(r"'/[^']*'")


def read_subtests(path: Path) -> dict[str, str]:
    """Subtest outcomes from the plugin's lines: failed if any report of it failed."""
    outcome: dict[str, str] = {}
    if not path.exists():
        return outcome
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            key = (
                _test_key(str(record["test"]))
                + " "
                + _TEMP_PATH.sub("'<path>'", str(record["subtest"]))
            )
            kind = str(record["outcome"])
        except (ValueError, KeyError, TypeError):
            continue
        if kind == "failed" or key not in outcome:
            outcome[key] = kind if kind in ("passed", "failed", "skipped") else "failed"
    return outcome


# The pytorch test files the table in docs/migrating.md was measured with (torch keeps
# no tag per test file; these are the stored versions closest to torch 2.13).
_MANIFEST = Path(__file__).with_suffix(".sha256")


def _measured_versions() -> dict[str, str]:
    known: dict[str, str] = {}
    if _MANIFEST.exists():
        for line in _MANIFEST.read_text().splitlines():
            digest, _, rel = line.partition("  ")
            if rel and not line.startswith("#"):
                known[rel] = digest
    return known


def _note_other_versions(root: Path, rels: tuple[str, ...]) -> None:
    """Say which copied files differ from the versions the documented table used:
    counts from other versions of torch's tests are not comparable."""
    known = _measured_versions()
    for rel in rels:
        top = root / rel
        for path in sorted(top.rglob("*") if top.is_dir() else [top]):
            name = path.relative_to(root).as_posix()
            if (
                path.is_file()
                and name in known
                and hashlib.sha256(path.read_bytes()).hexdigest() != known[name]
            ):
                print(f"note: {name} is not the version in {_MANIFEST.name}")


def materialize(suite: Suite, nvidia: Path | None, pytorch: Path | None, into: Path) -> bool:
    """Copy the suite's files into `into`; False when its source was not given or lacks
    them."""
    if suite.source.startswith("nvidia@"):
        if nvidia is None:
            return False
        tag = suite.source.split("@", 1)[1]
        archive = subprocess.run(
            ["git", "-C", str(nvidia), "archive", tag, *suite.paths],
            check=False,
            capture_output=True,
        )
        if archive.returncode != 0:
            print(f"{suite.name}: git archive {tag} failed: {archive.stderr.decode()[:200]}")
            return False
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
        return True
    if pytorch is None:
        return False
    for rel in suite.paths:
        src = pytorch / rel
        if not src.exists():
            print(f"{suite.name}: {src} not found")
            return False
        dst = into / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dst)
    _note_other_versions(into, suite.paths)
    return True


def rewrite_tree(root: Path, rewrite: Callable[[str], str]) -> None:
    for path in root.rglob("*.py"):
        text = path.read_text()
        new = rewrite(text)
        if new != text:
            path.write_text(new)


_RESULT = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def _pytest_argv(python: str, suite: Suite, *extra: str) -> list[str]:
    return [
        python,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        *extra,
        *suite.targets,
        *(f"--ignore={p}" for p in suite.ignore),
    ]


_SUMMARY = re.compile(rb"^=+ .*\b(passed|failed|error|skipped|no tests ran)\b.* in [0-9.]+s", re.M)


def _wait_for_pytest(proc: subprocess.Popen[bytes], log: Path, wall_s: float) -> int:
    """pytest's exit status; -9 when it had to be ended: past `wall_s`, or 30 s after it
    printed its summary (seen: a test's forked child that outlives its test, which
    multiprocessing's exit handler then waits for without end)."""
    deadline = time.monotonic() + wall_s
    summary_at: float | None = None
    while True:
        try:
            return proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if summary_at is None and _SUMMARY.search(log.read_bytes()[-4096:]):
            summary_at = now
        if now > deadline or (summary_at is not None and now - summary_at > 30):
            return -int(signal.SIGKILL)


def _run_in_own_group(
    argv: list[str],
    cwd: Path,
    log: Path,
    wall_s: float,
    env: dict[str, str] | None = None,
) -> None:
    """Run pytest in a session of its own, then end whatever of it is left: some suites
    fork children that outlive a killed parent and go on running the session."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            status = _wait_for_pytest(proc, log, wall_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        # A suite cut short shows why here (a negative status: the signal that ended it).
        out.write(f"\n# pytest exit status {status}\n".encode())


def _test_key(node_id: str) -> str:
    path, sep, rest = node_id.partition("::")
    return path.rsplit("/", 1)[-1] + sep + rest


def run_pytest(python: str, cwd: Path, suite: Suite, log: Path, wall_s: float) -> Outcome:
    """Outcomes read from pytest's per-test lines as they were printed, so a suite that
    kills its own pytest process (some of NVIDIA's hard-timeout tests) still counts: a
    collected test with no line counts as failed. The run is ended after `wall_s`."""
    collect_log = log.with_suffix(".collect")
    _run_in_own_group(
        _pytest_argv(python, suite, "--collect-only", "-q"), cwd, collect_log, wall_s=300
    )
    # Collected ids are relative to the rootdir pytest picked, the -v lines to the
    # invocation folder: compare from the file name on.
    collected = {
        _test_key(line.strip())
        for line in collect_log.read_text(errors="replace").splitlines()
        if "::" in line and not line.startswith(" ")
    }
    plugin_dir = log.with_suffix(".plugin")
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / f"{_SUBTEST_PLUGIN_NAME}.py").write_text(_SUBTEST_PLUGIN)
    subtest_log = log.with_suffix(".subtests")
    subtest_log.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin_dir), env.get("PYTHONPATH")) if p)
    env["STALWART_UPSTREAM_SUBTESTS"] = str(subtest_log)
    t0 = time.monotonic()
    argv = _pytest_argv(
        python, suite, "-v", "-p", _SUBTEST_PLUGIN_NAME, "--timeout", str(suite.timeout_s)
    )
    _run_in_own_group(argv, cwd, log, wall_s, env=env)
    seconds = time.monotonic() - t0
    outcome: dict[str, str] = {}
    for line in log.read_text(errors="replace").splitlines():
        match = _RESULT.match(line)
        if match is None:
            continue
        test, kind = match.groups()
        test = _test_key(test)
        if kind in ("FAILED", "ERROR"):
            outcome[test] = "failed"
        elif test not in outcome:
            outcome[test] = "skipped" if kind in ("SKIPPED", "XFAIL") else "passed"
    for test in collected - outcome.keys():
        outcome[test] = "failed"
    return Outcome(outcome, read_subtests(subtest_log), seconds)


def _stamp() -> str:
    """UTC time and the load average, printed with every result: the machine is shared,
    and tests with wall-clock limits fail under load."""
    one, five, _ = os.getloadavg()
    return f"{time.strftime('%H:%M:%S', time.gmtime())} UTC, load {one:.1f}/{five:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvidia", type=Path, help="git clone of NVIDIA/nvidia-resiliency-ext")
    parser.add_argument("--pytorch", type=Path, help="checkout of pytorch/pytorch")
    parser.add_argument(
        "--ref-python",
        action="append",
        default=[],
        metavar="KEY=PYTHON",
        help="interpreter with the original installed; KEY is 0.2.1, 0.4.1 or torch",
    )
    parser.add_argument("--only", default="", help="run suites whose name contains this")
    parser.add_argument("--keep", type=Path, help="keep the rewritten copies here")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument(
        "--run-limit",
        type=float,
        default=60.0,
        metavar="MINUTES",
        help="end a pytest run after this long (default 60: at load 25 on 2 cores "
        "torch's api_test.py took 20 minutes)",
    )
    args = parser.parse_args()
    if not args.run_limit > 0:
        parser.error(f"--run-limit {args.run_limit}: expected a positive number of minutes")
    wall_s = args.run_limit * 60
    refs: dict[str, str] = {}
    for item in args.ref_python:
        key, sep, python = item.partition("=")
        if not sep or not python:
            parser.error(f"--ref-python {item!r}: expected KEY=PYTHON, e.g. 0.4.1=/venv/bin/python")
        refs[key] = python
    refs.setdefault("torch", sys.executable)
    stalwart_root = Path(__file__).resolve().parent.parent

    rows: list[tuple[str, str, str, str, str, str]] = []
    lost: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="stalwart-upstream-") as tmp:
        base = args.keep or Path(tmp)
        for index, suite in enumerate(SUITES):
            if args.only and args.only not in suite.name:
                continue
            orig_dir = base / f"{index}-original"
            ours_dir = base / f"{index}-stalwart"
            for d in (orig_dir, ours_dir):
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir(parents=True)
            if not materialize(suite, args.nvidia, args.pytorch, orig_dir):
                rows.append((suite.name, "-", "not available", "-", "-", "-"))
                continue
            shutil.rmtree(ours_dir)
            shutil.copytree(orig_dir, ours_dir)
            rewrite_tree(ours_dir, suite.rewrite)
            ref_python = refs.get(suite.ref)
            original: Outcome | None = None
            print(f"{suite.name}: started {_stamp()}", flush=True)
            if ref_python and not args.skip_reference:
                original = run_pytest(
                    ref_python, orig_dir, suite, base / f"{index}-original.log", wall_s
                )
                print(
                    f"{suite.name}: original done {_stamp()} ({original.seconds:.0f} s)",
                    flush=True,
                )
            ours = run_pytest(
                str(stalwart_root / ".venv" / "bin" / "python")
                if (stalwart_root / ".venv").exists()
                else sys.executable,
                ours_dir,
                suite,
                base / f"{index}-stalwart.log",
                wall_s,
            )
            reference = original.cell() if original else "-"
            reference_sub = original.subtest_cell() if original else "-"
            rows.append(
                (
                    suite.name,
                    str(len(ours.tests)),
                    reference,
                    ours.cell(),
                    reference_sub,
                    ours.subtest_cell(),
                )
            )
            if original is not None:
                lost[suite.name] = regressions(original, ours)
            print(
                f"{suite.name}: stalwart done {_stamp()} ({ours.seconds:.0f} s); "
                f"original {reference} (subtests {reference_sub}); "
                f"stalwart {ours.cell()} (subtests {ours.subtest_cell()})",
                flush=True,
            )

    print()
    print("| suite | tests | original | stalwart | original subtests | stalwart subtests |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for name, names in lost.items():
        if names:
            print(f"\n{name}: pass under the original, not under stalwart:")
            for test in names:
                print(f"  {test}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
