"""Single-process tests of the NVIDIA-compatible surface: hook shapes, Compose,
the exception hierarchy, bundled hooks, and the NCCL abort (GPU stood in for)."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

import stalwart.inprocess as inprocess
from stalwart.inprocess import (
    AbortTorchDistributed,
    Call,
    CallWrapper,
    Compose,
    ConfigError,
    State,
    Wrapper,
    abort_nccl_communicators,
)
from stalwart.inprocess.call import inject_call


def _state(rank: int = 0, world: int = 2, iteration: int = 0) -> State:
    return State(
        rank=rank,
        world_size=world,
        initial_rank=rank,
        initial_world_size=world,
        iteration=iteration,
        active_world_size=world,
    )


# -- hook shapes ---------------------------------------------------------------------


def _one(state: State) -> None: ...


def _two(state: State, exc: BaseException | None) -> None: ...


def _none() -> None: ...


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # one argument is NVIDIA 0.4's shape of these three: none fits neither
        ({"finalize": _none}, "finalize must be callable as finalize(state, exception)"),
        (
            {"health_check": _none},
            "health_check must be callable as health_check(state, exception)",
        ),
        ({"initialize": _two}, "initialize must be callable as initialize(state) -> state"),
        ({"rank_assignment": _none}, "rank_assignment must be callable as rank_assignment("),
        ({"abort": _two}, "abort must be callable as abort(state) -> state"),
    ],
)
def test_hook_of_the_wrong_shape_is_refused_at_construction(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Wrapper(**kwargs)


def test_hooks_of_nvidia_shape_are_accepted() -> None:
    class Finalize(inprocess.finalize.Finalize):
        def __call__(self, state: State, train_ex: BaseException | None = None) -> None: ...

    Wrapper(
        finalize=Finalize(),
        health_check=Compose(inprocess.health_check.FaultCounter(), _two),
        initialize=inprocess.initialize.RetryController(max_iterations=3),
        rank_assignment=Compose(inprocess.rank_assignment.ShiftRanks()),
    )


# -- Compose -------------------------------------------------------------------------


def test_compose_runs_last_first_and_chains_values() -> None:
    calls: list[str] = []

    def add(name: str, n: int) -> Any:
        def hook(state: State) -> State:
            calls.append(name)
            return dataclasses.replace(state, iteration=state.iteration + n)

        return hook

    composed = Compose(add("a", 1), add("b", 10), add("c", 100))
    assert composed(_state()).iteration == 111
    assert calls == ["c", "b", "a"]


def test_compose_spreads_tuples_and_passes_on_none() -> None:
    seen: list[tuple[int, str | None]] = []

    def check(state: State, exc: BaseException | None) -> tuple[State, BaseException | None]:
        seen.append((state.iteration, type(exc).__name__ if exc else None))
        return dataclasses.replace(state, iteration=state.iteration + 1), exc

    def acts_only(state: State, exc: BaseException | None) -> None:
        seen.append((state.iteration, "acts_only"))

    err = ValueError("x")
    state, exc = Compose(check, acts_only, check)(_state(), err)
    assert (state.iteration, exc) == (2, err)
    assert seen == [(0, "ValueError"), (1, "acts_only"), (1, "ValueError")]


def test_compose_of_rank_assignments_keeps_the_tuple() -> None:
    log: list[set[int]] = []

    def observe(state: State, terminated: set[int]) -> tuple[State, set[int]]:
        log.append(set(terminated))
        return state, terminated

    shift = inprocess.rank_assignment.ShiftRanks()
    placed, rest = Compose(shift, observe)(_state(1, 3), {0})
    assert (placed.rank, placed.world_size, set(rest), log) == (0, 2, set(), [{0}])


# -- names ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sub", "base"),
    [
        (inprocess.exception.HealthCheckError, inprocess.exception.RestartError),
        (inprocess.exception.InternalError, inprocess.exception.RestartError),
        (inprocess.exception.TimeoutError, inprocess.exception.RestartError),
        (inprocess.exception.RestartError, Exception),
        (inprocess.monitor_thread.RankShouldRestart, BaseException),
    ],
)
def test_nvidia_exception_hierarchy(sub: type, base: type) -> None:
    assert issubclass(sub, base)


def test_rank_should_restart_is_not_an_exception() -> None:
    assert not issubclass(inprocess.RankShouldRestart, Exception)
    # NVIDIA's RestartAbort means "gave up", not "restart now": a different class.
    assert not issubclass(inprocess.RestartAbort, (Exception, inprocess.RankShouldRestart))


@pytest.mark.parametrize(
    "annotation",
    ["CallWrapper", "Optional[CallWrapper]", "inprocess.CallWrapper | None", "Call | None"],
)
def test_call_wrapper_injected_by_any_spelling(annotation: str) -> None:
    def fn(x: int, call_wrapper: Any = None) -> None: ...

    fn.__annotations__["call_wrapper"] = annotation
    marker = CallWrapper(_state())
    assert isinstance(marker, Call)
    assert inject_call(fn, (1,), {}, marker) == ((1, marker), {})


# -- bundled hooks -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("faults", "max_faults", "raises"),
    [(1, 1, False), (2, 1, True), (5, None, False), (0, 0, False)],
)
def test_fault_counter(faults: int, max_faults: int | None, raises: bool) -> None:
    counter = inprocess.health_check.FaultCounter(max_rank_faults=max_faults)
    state = _state()
    assert counter(state, None) == (state, None)  # a check before an iteration is no fault
    outcome = None
    for _ in range(faults):
        try:
            counter(state, RuntimeError("fault"))
        except inprocess.exception.RestartError as exc:
            outcome = exc
    assert (outcome is not None) is raises


@pytest.mark.parametrize(
    ("controller", "iteration", "world", "message"),
    [
        ({"max_iterations": 2}, 1, 2, None),
        ({"max_iterations": 2}, 2, 2, "max_iterations=2"),
        ({"min_world_size": 2}, 3, 2, None),
        ({"min_world_size": 2}, 3, 1, "min_world_size=2"),
        ({"min_active_world_size": 3}, 0, 2, "min_active_world_size=3"),
    ],
)
def test_retry_controller(
    controller: dict[str, int], iteration: int, world: int, message: str | None
) -> None:
    retry = inprocess.initialize.RetryController(**controller)
    state = _state(0, world, iteration)
    if message is None:
        assert retry(state) is state
    else:
        with pytest.raises(inprocess.exception.RestartError, match=message):
            retry(state)


def test_threaded_finalize_times_out_and_reraises() -> None:
    import threading

    release = threading.Event()
    slow = inprocess.finalize.ThreadedFinalize(datetime.timedelta(seconds=0.2), release.wait)
    with pytest.raises(inprocess.exception.TimeoutError, match=r"did not return in 0\.2s"):
        slow(_state(), None)
    release.set()

    def boom() -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        inprocess.finalize.ThreadedFinalize(datetime.timedelta(seconds=5), boom)(_state())


def test_cuda_health_check_does_nothing_without_cuda() -> None:
    state, err = _state(), ValueError("x")
    assert inprocess.health_check.CudaHealthCheck()(state, err) == (state, err)


# -- NCCL abort (the GPU stood in for) -----------------------------------------------


class _Backend:
    def __init__(self, name: str, log: list[str]) -> None:
        self._name = name
        self.log = log

    def name(self) -> str:
        return self._name

    def _group_start(self) -> None:
        self.log.append("group_start")

    def _group_end(self) -> None:
        self.log.append("group_end")


class _Group:
    """Stands for a ProcessGroup whose CUDA backend is ``backend``."""

    def __init__(self, label: str, backend: str, log: list[str]) -> None:
        self.label = label
        self.backend = _Backend(backend, log)
        self.log = log

    def _get_backend(self, device: torch.device) -> _Backend:
        assert device.type == "cuda"
        return self.backend

    def abort(self) -> None:
        self.log.append(f"abort {self.label}")


def test_nccl_groups_aborted_newest_first_in_one_batch() -> None:
    log: list[str] = []
    groups = [_Group("world", "nccl", log), _Group("cpu", "gloo", log), _Group("tp", "nccl", log)]
    aborted = abort_nccl_communicators(groups, cuda_available=lambda: True)
    assert [g.label for g in aborted] == ["world", "tp"]
    assert log == ["group_start", "abort tp", "abort world", "group_end"]


def test_nccl_abort_does_nothing_without_cuda() -> None:
    log: list[str] = []
    assert abort_nccl_communicators([_Group("w", "nccl", log)], cuda_available=lambda: False) == []
    assert log == []


def test_default_abort_aborts_nccl_before_destroying_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[str] = []
    group = _Group("world", "nccl", log)
    # Only the GPU is stood in for: CUDA "present", one live NCCL group in torch's registry.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(dist.distributed_c10d._world.pg_names, group, "stand-in")
    monkeypatch.setattr(
        "stalwart.inprocess.abort.destroy_process_groups", lambda: log.append("destroy")
    )
    state = _state()
    assert AbortTorchDistributed(release_sockets=False)(state) is state
    assert log == ["group_start", "abort world", "group_end", "destroy"]


def test_store_kwargs_in_nvidia_spelling() -> None:
    from stalwart.inprocess.store import tcp_store
    from tests.helpers import free_port

    port = free_port()
    host = tcp_store(
        is_host=True,
        host_name="127.0.0.1",
        port=port,
        timeout=datetime.timedelta(seconds=5),
    )
    client = tcp_store(is_host=False, host_name="127.0.0.1", port=port, timeout=5.0)
    client.set("k", "v")
    assert host.get("k") == b"v"
