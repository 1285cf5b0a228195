"""The template does once what a framework leaves for its first call (prewarm.py): which
calls are due, what a hostile module gets from one, and a real template's workers."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from stalwart.launch.workers.prewarm import Prewarm, due, run
from tests.helpers import clean_env, events, stalwart

HERE = Path(__file__).parent
HF = "transformers.conversion_mapping"
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("imported", "names"),
    [
        ([], []),
        (["torch", "transformers"], []),  # never imports anything itself
        (["torch", HF], [f"{HF}.get_checkpoint_conversion_mapping"]),
        ([HF + "_fake", "xtransformers.conversion_mapping"], []),  # exact names only
    ],
)
def test_due_only_for_modules_the_template_holds(imported: list[str], names: list[str]) -> None:
    assert [p.name for p in due(imported)] == names


def _module(name: str, **attrs: object) -> ModuleType:
    mod = ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def _exit() -> None:
    sys.exit(3)


def _interrupt() -> None:
    raise KeyboardInterrupt


def _huge() -> None:
    raise ValueError("x" * 100_000)


@pytest.mark.parametrize(
    ("attr", "reason"),
    [
        ("absent", "not a function"),
        ("not callable", "not a function"),
        (_exit, "SystemExit: 3"),
        (_interrupt, "KeyboardInterrupt"),
        (_huge, "ValueError: xxx"),
    ],
)
def test_a_hostile_module_only_drops_its_prewarm(attr: object, reason: str) -> None:
    p = Prewarm("m", "f", ())
    mod = _module("m") if attr == "absent" else _module("m", f=attr)
    done, dropped = run([p, p], {"m": mod})
    assert done == [] and len(dropped) == 2
    assert dropped[0].startswith("m.f (") and reason in dropped[0] and len(dropped[0]) <= 500


def test_a_prewarm_runs_with_its_arguments_once() -> None:
    calls: list[tuple[str, ...]] = []
    mod = _module("m", f=lambda *a: calls.append(a))
    assert run([Prewarm("m", "f", ("gpt2",))], {"m": mod}) == (["m.f"], [])
    assert calls == [("gpt2",)]
    assert run([Prewarm("gone", "f", ())], {"m": mod})[1] == [
        "gone.f (not a function of the imported module)"
    ]


def test_warm_workers_start_with_the_mapping_a_first_save_builds(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = stalwart(
        *("--nproc-per-node", "1", "--preload", HF, "--log-dir", tmp_path / "l"),
        HERE / "programs" / "conversion_probe.py",
        out,
        env=clean_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path)),
    )
    assert proc.returncode == 0, proc.stderr
    probe = json.loads((out / "probe_0.json").read_text())
    assert probe["built"] is True, probe
    assert probe["entries"] > 100, probe  # transformers' own table, every model type
    ready = [e for e in events(tmp_path / "l") if e["event"] == "template_ready"]
    assert ready and ready[0]["prewarmed"] == [f"{HF}.get_checkpoint_conversion_mapping"], ready


def test_a_library_whose_prewarm_starts_a_thread_leaves_workers_cold(tmp_path: Path) -> None:
    # A stranger's package under the same name: its "prewarm" starts a thread, after
    # which forking would be unsafe.  The template says so; the job still runs (cold).
    pkg = tmp_path / "site" / "transformers"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "conversion_mapping.py").write_text(
        "import threading, time\n"
        "_checkpoint_conversion_mapping_cache = None\n"
        "def get_checkpoint_conversion_mapping(key):\n"
        "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    proc = stalwart(
        *("--nproc-per-node", "1", "--preload", HF, "--log-dir", tmp_path / "l"),
        HERE / "programs" / "conversion_probe.py",
        out,
        env=clean_env(PYTHONPATH=str(tmp_path / "site")),
    )
    assert proc.returncode == 0, proc.stderr
    evs = events(tmp_path / "l")
    unusable = [e for e in evs if e["event"] == "template_unusable"]
    assert unusable and "prewarm" in unusable[0]["reason"], [e["event"] for e in evs]
    assert "threads" in unusable[0]["reason"]
    assert json.loads((out / "probe_0.json").read_text())["built"] is False
