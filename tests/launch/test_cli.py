"""The command line: torchrun's flags, one-line errors for bad values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.cli import build_config
from stalwart.config import DEFAULT_PREFIX, ConfigError
from stalwart.launch.files.logs import Std
from tests.helpers import ROOT, clean_env, stalwart

from .helpers import SCRIPTS

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--redirects", "7", "--redirects '7'"),
        ("--tee", "0:3,x", "--tee '0:3,x'"),
        ("--nnodes", "two", "--nnodes 'two'"),
        ("--nproc-per-node", "-1", "--nproc-per-node '-1'"),
        ("--inject", "explode:rank=1,step=3", "unknown fault 'explode'"),
        ("--inject", "crash:rank=1", "step=N is required"),
        ("--local-ranks-filter", "a,b", "--local-ranks-filter 'a,b'"),
        ("--max-restarts", "-2", "--max-restarts -2"),
        ("--rdzv-backend", "zookeeper", "--rdzv-backend 'zookeeper'"),
        ("--hb-timeout", "-1", "hb_timeout"),
        ("--section-timeout", "forward", "'forward'"),
        ("--safety-factor", "0.5", "safety_factor"),
        ("--hang-signal", "SIGNOPE", "SIGNOPE"),
    ],
)
def test_bad_value_is_one_line_error(flag: str, value: str, needle: str, tmp_path: Path) -> None:
    proc = stalwart(flag, value, "--log-dir", tmp_path, SCRIPTS / "envdump.py", tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0]
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir()), "nothing may be started or written on a bad flag"


def test_torchrun_spellings_and_per_rank_maps() -> None:
    cfg, _ = build_config(
        [
            "--nproc_per_node",
            "3",
            "--max_restarts=2",
            "-r",
            "0:3,2:1",
            "-t",
            "2",
            "--local_ranks_filter",
            "0,2",
            "--role",
            "trainer",
            "-m",
            "pkg.mod",
            "--",
            "--x",
            "1",
        ]
    )
    assert cfg.nproc_per_node == 3 and cfg.max_restarts == 2
    assert cfg.redirects == {0: Std.ALL, 2: Std.OUT}
    assert cfg.tee == Std.ERR
    assert cfg.local_ranks_filter == {0, 2}
    assert cfg.role == "trainer" and cfg.module and cfg.entrypoint == "pkg.mod"
    assert cfg.args == ["--x", "1"]


def test_precedence_defaults_yaml_env_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("max-restarts: 4\nshutdown_timeout: 7\nmonitor_interval: 0.5\n")
    monkeypatch.setenv("STALWART_SHUTDOWN_TIMEOUT", "9")
    cfg, _ = build_config(["--config", str(conf), "--monitor-interval", "0.2", "x.py"])
    assert cfg.max_restarts == 4  # YAML over default
    assert cfg.shutdown_timeout == 9.0  # env over YAML
    assert cfg.monitor_interval == 0.2  # flag over YAML
    with pytest.raises(ConfigError, match="--module and --no-python"):
        build_config(["-m", "--no-python", "x"])


def test_script_flags_are_never_taken_for_ours() -> None:
    cfg, _ = build_config(
        ["--nproc-per-node", "2", "train.py", "--out", "x", "--max-restarts", "9"]
    )
    assert cfg.entrypoint == "train.py"
    assert cfg.args == ["--out", "x", "--max-restarts", "9"]
    assert cfg.max_restarts == 0


def test_hang_detection_precedence_and_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("monitor:\n  hb_timeout: 7\n  section_timeouts: {fwd: 3}\n  safety_factor: 2\n")
    monkeypatch.setenv("STALWART_SAFETY_FACTOR", "4")
    cfg, _ = build_config(
        ["--config", str(conf), "--hb-timeout", "5", "--section-timeout", "bwd=9", "x.py"]
    )
    m = cfg.monitor
    assert m.hb_timeout == 5.0  # flag over YAML
    assert m.safety_factor == 4.0  # env over YAML
    assert m.section_timeouts == {"bwd": 9.0}  # a flag replaces the YAML mapping
    with pytest.raises(ConfigError, match="hb_initial_timeout"):
        build_config(["--hb-timeout", "5", "--hb-initial-timeout", "2", "x.py"])


def test_torchelastic_prefix_template_env_as_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun 2.13 reads TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE; an empty value is unset."""
    for k in ("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "STALWART_LOG_LINE_PREFIX_TEMPLATE"):
        monkeypatch.delenv(k, raising=False)
    conf = tmp_path / "c.yaml"
    conf.write_text("log_line_prefix_template: 'yaml-${rank}:'\n")
    assert build_config(["x.py"])[0].log_line_prefix_template == DEFAULT_PREFIX
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "")
    assert build_config(["x.py"])[0].log_line_prefix_template == DEFAULT_PREFIX
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "te-${local_rank}:")
    assert build_config(["x.py"])[0].log_line_prefix_template == "te-${local_rank}:"
    cfg, _ = build_config(["--config", str(conf), "x.py"])
    assert cfg.log_line_prefix_template == "te-${local_rank}:"  # env over YAML
    monkeypatch.setenv("STALWART_LOG_LINE_PREFIX_TEMPLATE", "st-${rank}:")
    assert build_config(["x.py"])[0].log_line_prefix_template == "st-${rank}:"
    cfg, _ = build_config(["--log-line-prefix-template", "flag:", "x.py"])
    assert cfg.log_line_prefix_template == "flag:"  # the flag over both


def test_torchelastic_prefix_template_reaches_the_console(tmp_path: Path) -> None:
    env = clean_env(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="<${role_name}|${local_rank}>")
    proc = stalwart(
        "--nproc-per-node",
        "2",
        "--tee",
        "3",
        "--log-dir",
        tmp_path,
        "--no-python",
        "sh",
        "-c",
        "echo hello",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "<default|0>hello" in proc.stdout and "<default|1>hello" in proc.stdout


def _argv_cases(tmp: Path) -> list[tuple[list[str], str]]:
    afile = tmp / "afile"
    afile.write_text("")
    script = tmp / "noexec.sh"
    script.write_text("#!/bin/sh\n")
    return [
        (["--shutdown-timeout", "nan"], "--shutdown-timeout nan"),
        (["--shutdown-timeout", "inf"], "--shutdown-timeout inf"),
        (["--monitor-interval", "inf"], "--monitor-interval inf"),
        (["--monitor-interval", "1e12"], "--monitor-interval 1000000000000.0"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "host:99999"], "port 99999"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "host:-1"], "port -1"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "a:2379,b:70000"], "port 70000"),
        (["--rdzv-id", "a/b"], "--rdzv-id 'a/b'"),
        (["--rdzv-id", ".."], "--rdzv-id '..'"),
        (["--redirects", "0:3,0:1"], "local rank 0 is given twice"),
        (["--tee", "1:1,1:2"], "local rank 1 is given twice"),
        (["--nproc-per-node", "99999"], "more workers than this machine can run"),
        (["--log-dir", str(afile)], "is not a folder"),
        (["--log-dir", str(afile / "sub")], "is not a folder"),
        (["--no-python", "no-such-program-xyz"], "no such program on PATH"),
        (["--no-python", str(tmp / "missing")], "no such file"),
        (["--no-python", str(script)], "not executable"),
        (["--master-port", "x"], "--master_port: invalid int value: 'x'"),
        (["--start-method", "thread"], "argument --start-method"),
        (["--no-such-flag", "1"], "unrecognized arguments"),
    ]


@pytest.mark.parametrize("case", range(20))
def test_bad_input_is_one_line_error_table(tmp_path: Path, case: int) -> None:
    """Each bad input: exit 2 (argparse's usage status), one line naming the value, no
    traceback, and nothing made on disk (no run folder, no monitor folder)."""
    work = tmp_path / "work"
    work.mkdir()
    argv, needle = _argv_cases(work)[case]
    if "--log-dir" not in argv:
        argv += ["--log-dir", str(tmp_path / "logs")]
    if "--no-python" not in argv:
        argv.append(str(SCRIPTS / "envdump.py"))
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    proc = stalwart(*argv, tmp_path, env=clean_env(TMPDIR=str(private_tmp)))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0] and lines[0].startswith("stalwart run: error: "), lines[0]
    assert not (tmp_path / "logs").exists()
    assert set(work.iterdir()) <= {work / "afile", work / "noexec.sh"}
    assert not any(private_tmp.iterdir())


def test_usage_error_points_to_help(tmp_path: Path) -> None:
    proc = stalwart("--max-restarts", "many", SCRIPTS / "envdump.py")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "stalwart run: error: argument --max-restarts/--max_restarts: invalid int value: "
        "'many' (see 'stalwart run --help')"
    )


def test_yaml_error_is_one_line(tmp_path: Path) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("max_restarts: [1,\nrole: x\n")
    with pytest.raises(ConfigError) as info:
        build_config(["--config", str(conf), "x.py"])
    assert "\n" not in str(info.value) and str(conf) in str(info.value)


def test_yaml_takes_torchruns_key_names(tmp_path: Path) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("rdzv_id: job-7\nnproc_per_node: 2\n")
    cfg, _ = build_config(["--config", str(conf), "x.py"])
    assert cfg.run_id == "job-7" and cfg.nproc_per_node == 2


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("rdzv_idx: job-7\n", "unknown key 'rdzv_idx'"),
        ("hb_timeout: 5\n", "unknown key 'hb_timeout' (hang-detection settings go under"),
        ("rdzv_id: a\nrun_id: b\n", "'rdzv_id' and 'run_id' set the same setting"),
    ],
)
def test_yaml_key_that_sets_nothing_is_one_line(tmp_path: Path, text: str, needle: str) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text(text)
    with pytest.raises(ConfigError) as info:
        build_config(["--config", str(conf), "x.py"])
    assert "\n" not in str(info.value)
    assert needle in str(info.value)
    if "unknown" in needle:
        assert "expected one of" in str(info.value) and "run_id" in str(info.value)


def _alias_bomb(value_key: str) -> str:
    """Nine levels of ten aliases each (10**9 values expanded) under a known key."""
    levels = ["&a [x,x,x,x,x,x,x,x,x,x]"] + [
        f"&{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 10)}]" for i in range(8)
    ]
    return f"{value_key}: [{', '.join(levels)}]\n"


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("oversized", "larger than 1048576 bytes; not a config file"),
        ("fifo", "not a regular file"),
        ("list", "expected a mapping of settings at the top level, got list"),
        ("bomb", "YAML aliases expand to more than 1048576 values"),
    ],
)
def test_a_hostile_config_file_is_one_line_and_starts_nothing(
    kind: str, needle: str, tmp_path: Path
) -> None:
    conf, out = tmp_path / "c.yaml", tmp_path / "out"
    out.mkdir()
    if kind == "fifo":
        os.mkfifo(conf)  # nothing ever writes it: a blocking open would hang the CLI
    elif kind == "oversized":
        conf.write_text("nproc_per_node: 1\n#" + "x" * (1 << 20) + "\n")
    elif kind == "list":
        conf.write_text("- nproc_per_node: 1\n")
    else:
        # Walking or printing it while checking the setting took minutes and GiBs.
        conf.write_text(_alias_bomb("log_line_prefix_template"))
    proc = stalwart(
        "--config", conf, "--log-dir", out / "logs", SCRIPTS / "envdump.py", out, timeout=30
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"stalwart run: error: --config {conf}: ") and needle in lines[0]
    assert not any(out.iterdir()), "nothing may be started or written on a bad --config"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("&a [*a]\n", "a YAML alias refers to a value that holds it"),
        ("max_restarts: &a {b: *a}\n", "a YAML alias refers to a value that holds it"),
        ("[" * 1000 + "]" * 1000, "YAML nested too deeply"),
        ("max_restarts: !!python/object/apply:os.getpid []\n", "cannot read YAML"),
        ("rdzv_id: &r job\nrun_id: *r\n", None),  # an alias to a plain value is fine
    ],
)
def test_config_file_aliases_and_tags(tmp_path: Path, text: str, needle: str | None) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text(text)
    if needle is None:
        cfg, _ = build_config(["--config", str(conf), "x.py"])
        assert cfg.run_id == "job"
        return
    with pytest.raises(ConfigError) as info:
        build_config(["--config", str(conf), "x.py"])
    assert "\n" not in str(info.value) and needle in str(info.value)
    assert str(info.value).startswith(f"--config {conf}: ")


def test_a_usage_error_loads_neither_torch_nor_the_monitor() -> None:
    """A mistyped flag is answered from the settings alone (the timing is in
    bench/bench_cli_usage.py)."""
    code = (
        "import sys\n"
        "from stalwart.cli import main\n"
        "code = main(['run', '--nproc-per-node', 'x', 'train.py'])\n"
        "heavy = ('torch', 'stalwart.monitor.node', 'stalwart.monitor.client', 'stalwart.launch.round.supervisor')\n"
        "print(code, sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), cwd=ROOT
    )
    assert out.stdout.strip() == "2 []", (out.stdout, out.stderr[-2000:])
    assert "--nproc-per-node 'x'" in out.stderr
