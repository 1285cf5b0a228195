"""Code written for NVIDIA's ``inprocess.Wrapper`` runs with only its import line changed.

``nvidia_inprocess_program.py`` is such a program; each scenario runs it as real
rank processes (gloo on CPU) with torchrun's environment.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.inprocess.harness import RankResult, launch

PROGRAM = Path(__file__).with_name("nvidia_inprocess_program.py")


def _run(scenario: str) -> list[RankResult]:
    return launch(scenario, world_size=2, timeout=80, program=PROGRAM)


@pytest.mark.timeout(90)
def test_nvidia_hooks_compose_and_rank_assignment_tuple() -> None:
    r0, r1 = _run("hooks")
    # Rank 1 faulted twice and failed its health check after the second: a
    # HealthCheckError, caught as NVIDIA's RestartError.
    assert r1.returncode == 3, r1.output[-4000:]
    assert r1.of("error") == [{**r1.of("error")[0], "type": "HealthCheckError", "health": True}], (
        r1.output[-4000:]
    )
    # Rank 0 went on alone and finished.
    assert r0.returncode == 0, r0.output[-4000:]
    assert r0.of("result")[-1]["value"] == 2
    assert [e["world_size"] for e in r0.of("enter")] == [2, 2, 1]

    # health_check(state, None) before each iteration; (state, exception) after a fault.
    checks = [(e["iteration"], e["exc"]) for e in r1.of("health_check")]
    assert checks == [(0, None), (0, "RuntimeError"), (1, None), (1, "RuntimeError")], checks
    # On the survivor the post-fault check gets the collective's error, or None
    # if the restart reached it outside a collective: either way two per faulted
    # iteration, the first (pre-iteration) with None.
    survivor = [(e["iteration"], e["exc"]) for e in r0.of("health_check")]
    assert [it for it, _ in survivor] == [0, 0, 1, 1, 2], survivor
    assert [exc for it, exc in survivor[::2]] == [None, None, None], survivor
    # finalize(state, exception): the faulting rank gets its own exception.
    assert (0, "RuntimeError") in [(e["iteration"], e["exc"]) for e in r1.of("finalize")]
    # initialize(state) -> state ran each iteration; the composed abort ran after each fault.
    assert [e["iteration"] for e in r0.of("initialize")] == [0, 1, 2]
    assert [e["iteration"] for e in r0.of("abort")] == [0, 1]
    # rank_assignment(state, terminated) -> (state, terminated), chained by Compose.
    assignments = [(e["iteration"], e["terminated"]) for e in r0.of("rank_assignment")]
    assert assignments == [(0, []), (1, []), (2, [1])], assignments


@pytest.mark.timeout(90)
def test_nvidia_retry_controller_stops_restarting() -> None:
    for r in _run("retry"):
        assert r.returncode == 0, r.output[-4000:]
        assert [e["iteration"] for e in r.of("enter")] == [0, 1]
        err = r.of("error")
        assert [e["abort"] for e in err] == [True], r.output[-4000:]
        assert "max_iterations=2" in str(err[0]["message"])
