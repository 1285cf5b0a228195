"""Behaviour that NVIDIA's own inprocess test suite (0.2.1 and 0.4.1) checks, restated
as stalwart tests: how the wrapper says it gave up, and how it refuses a process
group that already exists.  See docs/migrating.md, "Checked against the originals'
own tests"."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

import stalwart.inprocess as inprocess
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, object]]:
    """A world of one, as torchrun would describe it, and fast wrapper settings."""
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(name, value)
    yield {
        "store_kwargs": {"port": free_port(), "timeout": datetime.timedelta(seconds=10)},
        "monitor_thread_interval": datetime.timedelta(milliseconds=5),
        "monitor_process_interval": datetime.timedelta(milliseconds=5),
    }


@pytest.mark.parametrize("limit", [1, 3])
def test_retry_limit_is_caught_as_restart_abort(one_rank: dict[str, object], limit: int) -> None:
    calls = 0

    @inprocess.Wrapper(
        initialize=inprocess.initialize.RetryController(max_iterations=limit), **one_rank
    )
    def always_fails() -> None:
        nonlocal calls
        calls += 1
        raise ZeroDivisionError("step")

    with pytest.raises(inprocess.exception.RestartAbort) as caught:
        always_fails()
    assert calls == limit
    # stalwart's own name for the same end still catches it.
    assert isinstance(caught.value, inprocess.exception.RestartError)
    assert f"max_iterations={limit}" in str(caught.value)


def test_restart_abort_from_a_hook_leaves_unchanged(one_rank: dict[str, object]) -> None:
    class GiveUp:
        def __call__(self, state: inprocess.State) -> inprocess.State:
            raise inprocess.exception.RestartAbort("operator said stop")

    ran = False

    @inprocess.Wrapper(initialize=GiveUp(), **one_rank)
    def body() -> None:
        nonlocal ran
        ran = True

    with pytest.raises(inprocess.exception.RestartAbort, match="operator said stop"):
        body()
    assert not ran


def test_existing_default_group_is_a_value_error(one_rank: dict[str, object]) -> None:
    @inprocess.Wrapper(**one_rank)
    def body() -> int:
        return 1

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="already initialized"):
            body()
    finally:
        dist.destroy_process_group()
    # The refusal left nothing behind: the same wrapper runs once the group is gone.
    assert body() == 1


def _placed(rank: int, world: int) -> inprocess.State:
    return inprocess.State(rank=rank, world_size=world, initial_rank=rank, initial_world_size=world)


@pytest.mark.parametrize(
    ("make", "world", "active"),
    [
        (lambda: inprocess.rank_filter.MaxActiveWorldSize(None), 5, 5),
        (lambda: inprocess.rank_filter.MaxActiveWorldSize(3), 5, 3),
        (lambda: inprocess.rank_filter.MaxActiveWorldSize(8), 5, 5),
        (lambda: inprocess.rank_assignment.MaxActiveWorldSize(2), 4, 2),
        (lambda: inprocess.rank_filter.WorldSizeDivisibleBy(2), 7, 6),
        (lambda: inprocess.rank_filter.WorldSizeDivisibleBy(4), 7, 4),
        (lambda: inprocess.rank_filter.WorldSizeDivisibleBy(), 3, 3),
    ],
)
def test_rank_filters_under_nvidia_module_path(
    make: Callable[[], Callable[[inprocess.State], inprocess.State]], world: int, active: int
) -> None:
    keep = make()
    modes = [keep(_placed(rank, world)).mode for rank in range(world)]
    assert modes == [inprocess.Mode.ACTIVE] * active + [inprocess.Mode.INACTIVE] * (world - active)
    assert {keep(_placed(rank, world)).active_world_size for rank in range(world)} == {active}


@pytest.mark.parametrize(
    "make",
    [
        lambda: inprocess.rank_filter.MaxActiveWorldSize(0),
        lambda: inprocess.rank_filter.WorldSizeDivisibleBy(0),
    ],
)
def test_rank_filters_refuse_sizes_below_one(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError, match="0"):
        make()


def test_rank_should_restart_raised_by_the_function_restarts(one_rank: dict[str, object]) -> None:
    seen: list[tuple[int, str]] = []

    def note(state: inprocess.State, exc: BaseException | None) -> None:
        seen.append((state.iteration, type(exc).__name__))

    @inprocess.Wrapper(finalize=note, **one_rank)
    def asks_once(call_wrapper: inprocess.CallWrapper | None = None) -> int:
        assert call_wrapper is not None
        if call_wrapper.iteration == 0:
            raise inprocess.monitor_thread.RankShouldRestart
        return call_wrapper.iteration

    assert asks_once() == 1
    # The request was handled as a fault of iteration 0; iteration 1 then completed.
    assert seen[0][0] == 0 and seen[0][1] != "NoneType", seen
    assert seen[-1] == (1, "NoneType"), seen


def test_rank_should_restart_counts_against_the_retry_limit(one_rank: dict[str, object]) -> None:
    calls = 0

    @inprocess.Wrapper(
        initialize=inprocess.initialize.RetryController(max_iterations=2), **one_rank
    )
    def always_asks() -> None:
        nonlocal calls
        calls += 1
        raise inprocess.monitor_thread.RankShouldRestart

    with pytest.raises(inprocess.exception.RestartAbort):
        always_asks()
    assert calls == 2


def test_progress_tick_after_close_is_quiet() -> None:
    # NVIDIA's hard-timeout test ends a wrapper whose tick thread can beat once
    # more while the clock is unmapped; that beat must not raise (and log).
    from stalwart.inprocess.progress import ProgressClock

    clock = ProgressClock()
    clock.close()
    clock.tick()
    clock.ping()
    assert not os.path.exists(clock.path)


def test_state_built_without_arguments_is_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVIDIA's ``State()`` takes its identity from RANK/WORLD_SIZE; code that builds one
    that way (its own tests do) gets the same from ours, and keyword building still works."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    state = inprocess.state.State()
    assert (state.rank, state.world_size) == (3, 8)
    assert (state.initial_rank, state.initial_world_size) == (3, 8)
    assert state.iteration == 0
    state.rank = 5  # mutable, as NVIDIA's
    assert state.initial_rank == 3
    built = inprocess.state.State(rank=1, world_size=2, initial_rank=0, initial_world_size=4)
    assert (built.rank, built.initial_rank, built.initial_world_size) == (1, 0, 4)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert (inprocess.state.State().rank, inprocess.state.State().world_size) == (0, 1)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x': expected an integer"):
        inprocess.state.State()


def test_a_composed_chain_is_an_instance_of_the_class_its_hooks_share() -> None:
    """NVIDIA's Compose is an instance of the nearest class its hooks share, so a chain of
    ``Finalize`` subclasses still passes a type check for a ``Finalize``."""
    calls: list[str] = []

    class Mine(inprocess.finalize.Finalize):
        def __call__(self, state: object, exc: object) -> None:
            calls.append(type(self).__name__)

    class First(Mine):
        pass

    class Second(Mine):
        pass

    chain = inprocess.Compose(First(), Second())
    assert isinstance(chain, inprocess.Compose)
    assert isinstance(chain, Mine)
    assert not isinstance(chain, First) and not isinstance(chain, Second)
    chain(None, None)
    assert calls == ["Second", "First"]  # the last hook runs first, as there
    nested = inprocess.Compose(Mine(), First())
    assert isinstance(nested, Mine) and not isinstance(nested, First)
    # Plain functions share no class of the program's: a plain chain.
    plain = inprocess.Compose(lambda s, e: None, lambda s, e: None)
    assert type(plain) is inprocess.Compose


def test_a_chain_of_an_abstract_class_falls_back_to_a_plain_chain() -> None:
    import abc

    class Base(abc.ABC):
        @abc.abstractmethod
        def extra(self) -> None: ...

    class Hook(Base):
        def extra(self) -> None: ...

        def __call__(self, state: object) -> object:
            return state

    chain = inprocess.Compose(Hook(), Hook())
    assert type(chain) is not Hook and chain("s") == "s"
