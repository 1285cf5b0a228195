"""load_latest skips every step it cannot use (one warning each) and falls back to an
older one: unreadable manifests, folders and files, a manifest that is a folder, a
manifest that names no data file or one outside its step."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_state

from stalwart.checkpoint import AsyncCheckpointer, load_latest

_SETPRIV = shutil.which("setpriv")


def _saved(root: Path, steps: tuple[int, ...] = (1, 2)) -> None:
    with AsyncCheckpointer(root, keep_last=None, rank=0, world_size=1) as ckpt:
        for step in steps:
            ckpt.save(make_state(step, mib=0.05), step=step)
        ckpt.wait()


def _step2(root: Path) -> Path:
    return root / "step_000000002"


def _falls_back(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stalwart.checkpoint"):
        found = load_latest(root, rank=0)
    assert found is not None and found.step == 1
    assert torch.equal(found.state_dict["w"], make_state(1, mib=0.05)["w"])
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1 and "step 2" in skipped[0], skipped


def _rewrite_manifest(root: Path, files: dict[str, object]) -> None:
    path = _step2(root) / "rank_0.manifest.json"
    doc = json.loads(path.read_bytes())
    doc["files"] = files
    path.write_text(json.dumps(doc))


@pytest.mark.timeout(60)
def test_manifest_that_is_a_folder_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _saved(tmp_path)
    manifest = _step2(tmp_path) / "rank_0.manifest.json"
    manifest.unlink()
    manifest.mkdir()
    _falls_back(tmp_path, caplog)


@pytest.mark.timeout(60)
def test_manifest_symlink_loop_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # ELOOP: an unreadable manifest that root cannot read either.
    _saved(tmp_path)
    manifest = _step2(tmp_path) / "rank_0.manifest.json"
    manifest.unlink()
    manifest.symlink_to(manifest.name)
    _falls_back(tmp_path, caplog)


@pytest.mark.timeout(60)
def test_manifest_naming_no_files_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _saved(tmp_path)
    # With nothing listed nothing is checked: the garbage must not reach torch.load.
    (_step2(tmp_path) / "rank_0.pt").write_bytes(b"\x00garbage" * 100)
    _rewrite_manifest(tmp_path, {})
    _falls_back(tmp_path, caplog)


@pytest.mark.timeout(60)
def test_manifest_naming_a_file_outside_its_step_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _saved(tmp_path)
    one = json.loads((tmp_path / "step_000000001" / "rank_0.manifest.json").read_bytes())
    (_step2(tmp_path) / "rank_0.pt").write_bytes(b"\x00garbage" * 100)
    _rewrite_manifest(tmp_path, {"../step_000000001/rank_0.pt": one["files"]["rank_0.pt"]})
    _falls_back(tmp_path, caplog)


@pytest.mark.timeout(60)
def test_data_file_that_is_a_folder_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _saved(tmp_path)
    data = _step2(tmp_path) / "rank_0.pt"
    data.unlink()
    data.mkdir()
    _falls_back(tmp_path, caplog)


_LOAD = """
import logging, sys
from stalwart.checkpoint import load_latest
logging.basicConfig(level=logging.WARNING, format="%(message)s")
found = load_latest(sys.argv[1], rank=0)
print("LOADED", None if found is None else found.step)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("target", ["manifest", "data", "folder"])
def test_unreadable_step_is_skipped(tmp_path: Path, target: str) -> None:
    """Mode 000 on the newest step's manifest, data file or folder. Root reads through
    file modes, so as root the loader runs without CAP_DAC_OVERRIDE/READ_SEARCH."""
    _saved(tmp_path)
    victim = {
        "manifest": _step2(tmp_path) / "rank_0.manifest.json",
        "data": _step2(tmp_path) / "rank_0.pt",
        "folder": _step2(tmp_path),
    }[target]
    prefix: list[str] = []
    if os.geteuid() == 0:
        if _SETPRIV is None:
            pytest.skip("running as root and no setpriv to drop CAP_DAC_OVERRIDE")
        prefix = [_SETPRIV, "--bounding-set=-dac_override,-dac_read_search"]
    os.chmod(victim, 0)
    try:
        res = subprocess.run(
            [*prefix, sys.executable, "-c", _LOAD, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.chmod(victim, 0o700 if victim.is_dir() else 0o600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "LOADED 1" in res.stdout, (res.stdout, res.stderr[-2000:])
    warnings = [ln for ln in res.stderr.splitlines() if "skipping" in ln]
    assert len(warnings) == 1 and "step 2" in warnings[0], res.stderr[-2000:]
    assert "Permission denied" in warnings[0], warnings
