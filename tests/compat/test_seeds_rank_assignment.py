"""Rank assignment with NVIDIA ``inprocess``'s contract (issue 26 item 1): an assignment
renumbers from the numbers the last one gave, is told the ranks terminated since in
that numbering, and a terminated rank's own call raises ``RankDiscarded``.  The
wrapper keeps that contract across repeated faults by recording each rank's number in
its store; ``rank_numbering="initial"`` keeps stalwart's earlier one."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from stalwart.base.liveness import CounterWatch
from stalwart.inprocess import ConfigError, FillGaps, RankDiscarded, RestartError, ShiftRanks
from stalwart.inprocess.assignment import assignment_input
from stalwart.inprocess.options import Options
from stalwart.inprocess.state import State
from stalwart.inprocess.store import CoordStore
from tests.helpers import free_port
from tests.inprocess.harness import launch

PROGRAM = Path(__file__).parent / "programs" / "seeds_renumber.py"


def _now(rank: int, world: int, initial: int, initial_world: int) -> State:
    """A rank renumbered by an earlier assignment: its current numbers differ from its
    initial ones."""
    return State(
        rank=rank, world_size=world, initial_rank=initial, initial_world_size=initial_world
    )


@pytest.mark.parametrize(
    ("assignment", "state", "terminated", "expected"),
    [
        # current rank 3 of 5 (initially 4 of 6), current rank 0 terminated
        (ShiftRanks(), _now(3, 5, 4, 6), {0}, (2, 4)),
        (ShiftRanks(), _now(1, 5, 1, 6), {0, 4}, (0, 3)),
        # FillGaps: a rank above the new size takes the lowest gap below it
        (FillGaps(), _now(4, 5, 5, 6), {1}, (1, 4)),
        (FillGaps(), _now(3, 5, 5, 6), {1}, (3, 4)),
        # two terminated at the top: the movers only ever take gaps (NVIDIA's gives 7 -> 5)
        (FillGaps(), State(rank=7, world_size=8), {1, 4, 5}, (4, 5)),
        (FillGaps(), State(rank=6, world_size=8), {1, 4, 5}, (1, 5)),
    ],
)
def test_assignments_renumber_from_the_current_numbers(
    assignment: ShiftRanks | FillGaps,
    state: State,
    terminated: set[int],
    expected: tuple[int, int],
) -> None:
    placed, rest = assignment(state, terminated)
    assert (placed.rank, placed.world_size) == expected
    assert not rest
    assert placed.initial_rank == state.initial_rank  # identity is kept


def test_a_rank_terminated_in_the_current_numbering_is_discarded() -> None:
    # initial rank 4 now has rank 2: a terminated "2" means it, whatever its initial rank
    with pytest.raises(RankDiscarded) as info:
        ShiftRanks()(_now(2, 4, 4, 6), {2})
    assert isinstance(info.value, RestartError)  # NVIDIA's base class


@pytest.mark.parametrize(
    ("numbering", "last", "terminated", "accounted", "numbers", "expected"),
    [
        # current: the last numbers, and only the ranks gone since, in those numbers
        ("current", (1, 4), frozenset({2, 3}), frozenset({2}), {3: 0}, ((1, 4), {0})),
        ("current", (0, 5), frozenset(), frozenset(), {}, ((0, 5), set())),
        # initial: the initial numbers and everyone gone
        ("initial", (1, 4), frozenset({2, 3}), frozenset({2}), {}, ((4, 6), {2, 3})),
    ],
)
def test_what_the_assignment_is_given(
    numbering: str,
    last: tuple[int, int],
    terminated: frozenset[int],
    accounted: frozenset[int],
    numbers: dict[int, int],
    expected: tuple[tuple[int, int], set[int]],
) -> None:
    given, gone = assignment_input(
        numbering, _now(1, 4, 4, 6), last, terminated, accounted, numbers
    )
    assert ((given.rank, given.world_size), gone) == expected


def test_a_rank_gone_without_a_recorded_number_stops_the_renumbering() -> None:
    with pytest.raises(RestartError, match=r"initial ranks \[3\] left before"):
        assignment_input("current", _now(1, 4, 1, 5), (1, 4), frozenset({3}), frozenset(), {})


def test_forged_rank_numbers_in_the_store_are_not_believed() -> None:
    """A stranger who reaches the store writes junk where ranks record their numbers."""
    server = TCPStore(
        "127.0.0.1", free_port(), is_master=True, timeout=datetime.timedelta(seconds=10)
    )
    coord = CoordStore(server, 0, CounterWatch[int](5.0))
    coord.publish_placed_rank(3, 2)
    forged = {1: "-1", 2: "9" * 5000, 4: "abc", 5: "7", 6: "", 7: "1e3"}
    for rank, value in forged.items():
        coord.store.set(f"it3/placed/{rank}", value)
    assert coord.placed_ranks(3, [0, 1, 2, 4, 5, 6, 7, 8], world_size=4) == {0: 2}


def test_an_unknown_numbering_is_refused_by_name() -> None:
    with pytest.raises(
        ConfigError, match=r"rank_numbering must be one of 'current', 'initial', got 'nvidia'"
    ):
        Options(rank_numbering="nvidia")  # type: ignore[arg-type]


def _final_ranks(extra: dict[str, str]) -> dict[int, list[tuple[int, int, int]]]:
    results = launch(
        "renumber",
        world_size=5,
        timeout=150,
        program=PROGRAM,
        env={"LEAVERS": "2,1", "WRAPPER_OPTIONS": json.dumps(extra)},
    )
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for r in results:
        if r.rank in (1, 2):
            assert r.returncode == 5, r.output[-3000:]
            continue
        assert r.returncode == 0, r.output[-3000:]
        seen[r.rank] = [(e["iteration"], e["rank"], e["world_size"]) for e in r.of("enter")]
        # run once: the program has no __main__ guard and must not be run again
        assert len(r.of("result")) == 1, r.output[-3000:]
    return seen


@pytest.mark.timeout(180)
def test_repeated_faults_renumber_from_the_current_ranks() -> None:
    """Five ranks, FillGaps.  Initial rank 2 leaves: 4 takes rank 2.  Then initial 1 (rank
    1 of 4) leaves: the rank at 3 of 4 (initial 3) takes 1 and initial 4 keeps 2.
    Placing from the initial ranks instead (stalwart before) gave initial 3 rank 2 and
    initial 4 rank 1."""
    seen = _final_ranks({})
    assert seen[0] == [(0, 0, 5), (1, 0, 4), (2, 0, 3)]
    assert seen[3] == [(0, 3, 5), (1, 3, 4), (2, 1, 3)]
    assert seen[4] == [(0, 4, 5), (1, 2, 4), (2, 2, 3)]
