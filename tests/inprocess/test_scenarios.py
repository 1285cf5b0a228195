"""Multi-process scenarios: real ranks, gloo on CPU, faults injected by worker.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import RankResult, launch, launch_torchrun


def _entries(result: RankResult) -> list[dict[str, object]]:
    return result.of("enter")


def _final(result: RankResult) -> dict[str, object]:
    done = result.of("done")
    assert done, result.output[-4000:]
    return done[-1]


@pytest.mark.timeout(60)
def test_exception_restarts_all_ranks_and_releases_blocked_peer() -> None:
    r0, r1 = launch("exception")
    for r in (r0, r1):
        assert r.returncode == 0, r.output[-4000:]
        assert [e["iteration"] for e in _entries(r)] == [0, 1]
        # In-memory progress survives: step counting resumed, not restarted.
        assert r.of("result")[-1]["value"] == 10
        assert _final(r)["world_size"] == 2
    fault_t = float(r1.of("fault")[0]["t"])  # type: ignore[arg-type]
    # Rank 0 was blocked in all_reduce (gloo timeout 30 s) when rank 1 raised.
    blocked = [e for e in r0.of("step_begin") if e["iteration"] == 0 and e["step"] == 5]
    assert blocked and float(blocked[0]["t"]) < fault_t  # type: ignore[arg-type]
    reentry = float(_entries(r0)[1]["t"])  # type: ignore[arg-type]
    assert reentry - fault_t < 3.0


@pytest.mark.timeout(60)
def test_soft_timeout_hang_restarts() -> None:
    results = launch("soft_hang")
    for r in results:
        assert r.returncode == 0, r.output[-4000:]
        assert [e["iteration"] for e in _entries(r)] == [0, 1]
        assert _final(r)["world_size"] == 2
    assert "soft timeout" in results[0].output + results[1].output


@pytest.mark.timeout(60)
def test_main_thread_blocked_without_pings_is_a_soft_timeout() -> None:
    # No ping ever: the automatic timestamp is the only evidence, and only the main thread
    # running Python moves it (a tick thread would keep it fresh through any hang).
    r0, r1 = launch("blocked_no_ping")
    for r in (r0, r1):
        assert r.returncode == 0, r.output[-4000:]
        assert [e["iteration"] for e in _entries(r)] == [0, 1]
        assert _final(r)["world_size"] == 2
    assert "main thread ran no Python" in r0.output + r1.output
    fault_t = float(r1.of("fault")[0]["t"])  # type: ignore[arg-type]
    reentry = float(_entries(r0)[1]["t"])  # type: ignore[arg-type]
    # Soft timeout 1.5 s; gloo's own timeout (the only other way out) is far longer.
    assert reentry - fault_t < 10.0


@pytest.mark.timeout(60)
def test_hang_with_gil_held_terminates_rank_and_shifts(tmp_path: Path) -> None:
    logfile = tmp_path / "monitor-{rank}.log"
    r0, r1 = launch("gil_hang", env={"MONITOR_LOG": str(logfile)})
    assert r1.returncode != 0  # killed by its monitor process
    assert "hard timeout" in r1.output
    assert "hard timeout" in (tmp_path / "monitor-1.log").read_text()
    assert r0.returncode == 0, r0.output[-4000:]
    entries = _entries(r0)
    assert entries[-1]["world_size"] == 1 and entries[-1]["rank"] == 0
    assert _final(r0)["step"] == 6


@pytest.mark.timeout(60)
def test_sigkill_detected_by_heartbeat_survivor_shifts() -> None:
    r0, r1 = launch("sigkill")
    assert r1.returncode == -9
    assert r0.returncode == 0, r0.output[-4000:]
    assert _entries(r0)[-1]["world_size"] == 1
    assert _final(r0)["step"] == 6


@pytest.mark.timeout(60)
def test_sigkill_spare_takes_over() -> None:
    r0, r1, r2 = launch("sigkill", world_size=3, env={"SPARES": "1"})
    assert r1.returncode == -9
    for r in (r0, r2):
        assert r.returncode == 0, r.output[-4000:]
        assert _final(r)["world_size"] == 2
    # The spare never entered the function before the fault, then became rank 1.
    spare_entries = _entries(r2)
    assert [e["iteration"] for e in spare_entries] == [1]
    assert spare_entries[0]["rank"] == 1
    assert r2.of("result")[-1]["value"] == 6


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("leaver", "exc", "returncode"),
    [
        (0, "SystemExit", 7),  # the store host leaves: the store stays up for the peer
        (1, "KeyboardInterrupt", -2),  # Python re-raises SIGINT on an uncaught one
        (0, "GeneratorExit", 1),
        (1, "RestartAbort", 1),  # NVIDIA's terminal abort: ends it on that rank, no restart
    ],
)
def test_base_exception_leaves_unchanged_and_peer_goes_on(
    leaver: int, exc: str, returncode: int
) -> None:
    results = launch("base_exit", env={"LEAVER": str(leaver), "EXC": exc})
    left, peer = results[leaver], results[1 - leaver]
    # The rank that raised gets its own exception back, not a restart signal.
    assert [e["type"] for e in left.of("left")] == [exc], left.output[-4000:]
    assert left.returncode == returncode, left.output[-4000:]
    assert [e["iteration"] for e in _entries(left)] == [0]
    # The other rank treats it as terminated and finishes alone.
    assert peer.returncode == 0, peer.output[-4000:]
    assert [(e["iteration"], e["world_size"]) for e in _entries(peer)] == [(0, 2), (1, 1)]
    assert _final(peer)["step"] == 6
    assert "DistNetworkError" not in peer.output


@pytest.mark.timeout(60)
def test_failing_health_check_removes_rank() -> None:
    r0, r1 = launch("health")
    assert r1.returncode == 3
    err = r1.of("error")[0]
    assert err["type"] == "HealthCheckError"
    assert "rank 1" in str(err["message"]) and "iteration 0" in str(err["message"])
    assert r0.returncode == 0, r0.output[-4000:]
    assert _entries(r0)[-1]["world_size"] == 1
    assert _final(r0)["step"] == 5


@pytest.mark.timeout(60)
def test_hook_errors_are_reported_with_rank_and_iteration() -> None:
    r0, r1 = launch("hooks")
    # initialize failed on rank 1 in iteration 0: a restart, then success.
    assert "initialize hook failed on rank 1 in iteration 0" in r1.output
    assert [e["iteration"] for e in r1.of("initialize")] == [0, 1]
    assert r1.of("result")[-1]["value"] == 3
    # finalize failed on rank 0 after iteration 1: its own exception reaches the caller,
    # as with NVIDIA's wrapper, with a note that says where.
    err = r0.of("error")[0]
    assert err["type"] == "ValueError" and err["message"] == "bad finalize"
    assert err["notes"] == ["stalwart: raised by the finalize hook on rank 0 in iteration 1"]


@pytest.mark.timeout(60)
def test_max_iterations_stops_restarting() -> None:
    for r in launch("max_iterations"):
        err = r.of("error")[0]
        # stalwart's name and NVIDIA's for "no more restarts" both catch it.
        assert err["restart_error"] is True and err["restart_abort"] is True
        assert "max_iterations=2" in str(err["message"])


@pytest.mark.timeout(90)
def test_twenty_restarts_leak_no_threads_or_fds() -> None:
    results = launch("leaks", timeout=80, env={"RESTARTS": "20"})
    for r in results:
        assert r.returncode == 0, r.output[-4000:]
        assert r.of("result")[-1]["value"] == 20
        samples = r.of("resources")
        assert [s["iteration"] for s in samples] == list(range(21))
        threads = [int(s["threads"]) for s in samples]  # type: ignore[call-overload]
        fds = [int(s["fds"]) for s in samples]  # type: ignore[call-overload]
        # Iteration 0 may differ (lazy imports open files once); after that, flat.
        assert max(threads[1:]) == min(threads[1:]) == threads[1]
        # The store host's count wobbles by a connection or two (peers' clients
        # close asynchronously); one leaked fd per restart would add 20.
        assert max(fds[-5:]) <= max(fds[1:6]) + 2, fds


@pytest.mark.timeout(90)
@pytest.mark.parametrize("share_store", [True, False], ids=["agent-store", "own-store"])
def test_under_plain_torchrun(share_store: bool) -> None:
    # With the agent's store shared (torchrun's default) the wrapper coordinates
    # through it; with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 rank 0 hosts on MASTER_PORT.
    env = {} if share_store else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    rc, events, out = launch_torchrun("exception", env=env, timeout=80)
    assert rc == 0, out[-4000:]
    results = [e for e in events if e["kind"] == "result"]
    assert sorted(e["initial_rank"] for e in results) == [0, 1]
    assert all(e["value"] == 10 for e in results)
    entries = [e for e in events if e["kind"] == "enter"]
    assert sorted(e["iteration"] for e in entries) == [0, 0, 1, 1]


@pytest.mark.timeout(60)
def test_two_wrapped_calls_in_one_process() -> None:
    for r in launch("twice"):
        assert r.returncode == 0, r.output[-4000:]
        results = r.of("result")
        assert [e["job"] for e in results] == [0, 1]
        assert all(e["value"] == 4 for e in results)
        # The launcher's RANK is back after each call.
        assert all(e["rank_env"] == str(r.rank) for e in results)
