"""The shared test helpers do what the suite relies on."""

from __future__ import annotations

import pytest

from tests.helpers import START, clean_env, cold_only, warm_and_cold


def test_clean_env_drops_what_steers_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "STALWART_MAX_RESTARTS",
        "TORCHELASTIC_RESTART_COUNT",
        "SLURM_NNODES",
        "PET_NNODES",
        "JOB_COMPLETION_INDEX",
        "JOBSET_NAME",
        "REPLICATED_JOB_NAME",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
    ):
        monkeypatch.setenv(name, "4")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("SOMETHING_ELSE", "kept")
    env = clean_env(EXTRA="1")
    assert not [k for k in env if k.startswith(("STALWART_", "TORCHELASTIC_", "SLURM_", "PET_"))]
    assert not {"JOB_COMPLETION_INDEX", "JOBSET_NAME", "REPLICATED_JOB_NAME"} & set(env)
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in env
    assert "OMP_NUM_THREADS" not in env
    assert env["SOMETHING_ELSE"] == "kept" and env["EXTRA"] == "1"


@warm_and_cold
def test_each_start_mode_reaches_the_launchers_environment(start_mode: str) -> None:
    assert START["warm"] == (start_mode == "warm")
    assert clean_env().get("STALWART_WARM") == (None if start_mode == "warm" else "0")


@cold_only
def test_cold_only_turns_warm_starts_off() -> None:
    assert clean_env()["STALWART_WARM"] == "0"


def test_an_unmarked_test_gets_stalwarts_default() -> None:
    assert START["warm"] and "STALWART_WARM" not in clean_env()
