"""NVIDIA ``inprocess`` 0.4's ``rank_assignment.Tree``/``Layer``/``LayerFlag`` on
``stalwart.inprocess`` (issue 26 item 1): the decision as tables over typed seats, the
key exchange through a real store with hostile and forged entries, and a real gloo job
where a reserve rank takes a killed rank's place."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from stalwart.inprocess.assignment import RankAssignmentCtx, discarded_by, function_view
from stalwart.inprocess.errors import RankDiscarded, RestartError
from stalwart.inprocess.rank_tree import (
    KEY_LIMIT,
    STORE_PREFIX,
    Entry,
    Layer,
    LayerFlag,
    LayerRule,
    Tree,
    build_topology,
    first_seats,
    group_key,
    parse_entry,
    reassign,
)
from stalwart.inprocess.state import Mode, State
from tests.inprocess.harness import launch

PROGRAM = Path(__file__).parent / "programs" / "seeds_rank_tree.py"
R, B = LayerFlag.RESERVE, LayerFlag.BACKFILL
NO = LayerFlag(0)


def _topology(world: int, rules: Sequence[LayerRule], group_of: Sequence[int] | None = None):  # type: ignore[no-untyped-def]
    """Two-level trees: a root and, below it, groups ``group_of[rank]`` (rank // 4 by default)."""
    groups = group_of if group_of is not None else [r // 4 for r in range(world)]
    entries = [
        Entry(r, r, (group_key(0, "root"), group_key(1, groups[r]))[: len(rules)])
        for r in range(world)
    ]
    topology = build_topology(rules, entries)
    return topology, first_seats(topology, list(range(world)), world)


def _active(seats) -> list[int | None]:  # type: ignore[no-untyped-def]
    return [s.active_rank for s in seats]


@pytest.mark.parametrize(
    ("rules", "terminated", "expected"),
    [
        # No flag: the gap is closed by shifting every higher number down.
        ((LayerRule(1, None, NO), LayerRule(1, None, NO)), {1}, [0, None, 1, 2, 3, 4, 5, 6]),
        # BACKFILL below the root only: the group's highest active number moves in.
        ((LayerRule(1, None, NO), LayerRule(1, None, B)), {1}, [0, None, 2, 1, 3, 4, 5, 6]),
        # BACKFILL up to the root: the job's highest number moves in, nothing shifts.
        ((LayerRule(1, None, B), LayerRule(1, None, B)), {1}, [0, None, 2, 3, 4, 5, 6, 1]),
        # A group below min_ranks is terminated whole; its numbers are closed up.
        ((LayerRule(1, None, NO), LayerRule(3, None, NO)), {0, 2}, [None] * 4 + [0, 1, 2, 3]),
        # The root below its min_ranks: everyone goes.
        ((LayerRule(7, None, NO), LayerRule(1, None, NO)), {0, 5}, [None] * 8),
        # Nothing terminated: nothing moves.
        ((LayerRule(1, None, B), LayerRule(1, None, B)), set(), list(range(8))),
    ],
)
def test_one_fault_as_a_table(
    rules: tuple[LayerRule, ...], terminated: set[int], expected: list[int | None]
) -> None:
    topology, seats = _topology(8, rules)
    after = reassign(topology, seats, terminated)
    assert _active(after) == expected
    live = sum(e is not None for e in expected)
    assert {s.active_world_size for s in after} == {live}
    assert {s.world_size for s in after} == {live}
    assert [s.mode is Mode.TERMINATED for s in after] == [e is None for e in expected]
    assert [s.rank for s in after if s.rank is not None] == list(range(live))


def test_reserves_replace_lost_ranks_across_three_faults() -> None:
    """``max_ranks=3`` per group of 4 leaves one reserve per group; a lost active rank
    takes its own group's reserve, then (with none left) the gap is shifted closed;
    terminated numbers are always in the last assignment's numbering."""
    topology, seats = _topology(8, (LayerRule(1, None, R), LayerRule(1, 3, R)))
    assert _active(seats) == [0, 1, 2, None, 3, 4, 5, None]
    assert [s.mode for s in seats].count(Mode.INACTIVE) == 2
    steps = [({1}, [0, None, 2, 1, 3, 4, 5, None]), ({3}, [0, None, 2, 1, None, 4, 5, 3])]
    steps.append(({1}, [0, None, None, 1, None, 3, 4, 2]))
    for terminated, expected in steps:
        seats = reassign(topology, seats, terminated)
        assert _active(seats) == expected


def test_backfill_pairs_the_lowest_lost_with_the_lowest_mover() -> None:
    topology, seats = _topology(
        8, (LayerRule(1, None, B), LayerRule(1, None, B)), [r // 2 for r in range(8)]
    )
    assert _active(reassign(topology, seats, {2, 3})) == [0, 1, None, None, 4, 5, 2, 3]


def test_a_reserve_group_refills_from_its_neighbour_through_a_reserve_root() -> None:
    """Group 0 loses three of four; min_ranks=2 terminates it whole, and its three
    active numbers go to the latest reserves found through the ``RESERVE`` root."""
    topology, seats = _topology(12, (LayerRule(1, None, R | B), LayerRule(2, 3, R | B)))
    seats = reassign(topology, seats, set())
    after = reassign(topology, seats, {0, 1, 2})
    assert _active(after) == [None, None, None, None, 3, 4, 5, 1, 6, 7, 2, 0]


def test_world_size_filter_sends_the_top_numbers_to_the_reserve() -> None:
    topology, seats = _topology(8, (LayerRule(1, None, R), LayerRule(1, None, R)))
    after = reassign(topology, seats, set(), lambda n: min(n, 6))
    assert _active(after) == [0, 1, 2, 3, 4, 5, None, None]
    assert {s.active_world_size for s in after} == {6}
    # The reserves the filter made are called back, the latest first, when a rank goes.
    again = reassign(topology, after, {0}, lambda n: min(n, 6))
    assert _active(again) == [None, 1, 2, 3, 4, 5, None, 0]
    assert [s.mode for s in again].count(Mode.INACTIVE) == 1


@pytest.mark.parametrize(
    ("answer", "why"),
    [(9, "from 0 to 8"), (-1, "from 0 to 8"), ("4", "integer"), (True, "integer")],
)
def test_a_filter_answering_out_of_range_is_refused_by_name(answer: object, why: str) -> None:
    topology, seats = _topology(8, (LayerRule(1, None, NO), LayerRule(1, None, NO)))
    with pytest.raises(ValueError, match=why):
        reassign(topology, seats, set(), lambda n: answer)  # type: ignore[arg-type,return-value]


def test_a_terminated_number_that_is_no_live_rank_is_refused() -> None:
    topology, seats = _topology(4, (LayerRule(1, None, NO), LayerRule(1, None, NO)))
    seats = reassign(topology, seats, {3})
    with pytest.raises(ValueError, match=r"terminated ranks \[3\] are not live ranks .*0 to 2"):
        reassign(topology, seats, {3})


def test_the_runner_shows_the_function_the_active_numbers() -> None:
    tree_state = State(
        5, 7, initial_rank=6, initial_world_size=8, active_rank=2, active_world_size=4
    )
    seen = function_view(tree_state)
    assert (seen.rank, seen.world_size, seen.initial_rank) == (2, 4, 6)
    plain = State(3, 4)
    assert function_view(plain) is plain
    gone = State(0, 4, initial_world_size=8, terminated=frozenset({1, 2, 99, -1}))
    assert discarded_by(gone, frozenset({1})) == {2}


def test_layers_are_checked_at_the_first_call_with_one_line() -> None:
    for bad, match in [
        (Layer(min_ranks=-1), "min_ranks must be an integer >= 0, got -1"),
        (Layer(max_ranks=2.5), r"max_ranks must be an integer >= 0 or None, got 2\.5"),  # type: ignore[arg-type]
        (Layer(flag="RESERVE"), "flag must be a LayerFlag or None"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(ValueError, match=match):
            LayerRule.of(0, bad)
    with pytest.raises(ValueError, match="non-empty list"):
        Tree([])
    with pytest.raises(ValueError, match="timeout must be a positive"):
        Tree([Layer()], timeout=0)


# -- the exchange through a real store ------------------------------------------------


def _store() -> dist.Store:
    return dist.HashStore()


def _ctx(store: object, rank: int, world: int) -> RankAssignmentCtx:
    return RankAssignmentCtx(State(rank, world), store, set())


def test_ranks_exchange_keys_through_a_store_and_agree() -> None:
    """Four ranks (threads) over one real store: a host per pair of ranks, one reserve
    per host; every rank computes the same seats."""
    store, world = _store(), 4
    layers = [
        Layer(key_or_fn="job", flag=R),
        Layer(max_ranks=1, key_or_fn=lambda s: s.rank // 2, flag=R),
    ]
    trees = [Tree(layers, timeout=30) for _ in range(world)]
    out: dict[int, RankAssignmentCtx] = {}

    def run(rank: int) -> None:
        out[rank] = trees[rank](_ctx(store, rank, world))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [(out[r].state.active_rank, out[r].state.mode) for r in range(world)] == [
        (0, Mode.ACTIVE),
        (None, Mode.INACTIVE),
        (1, Mode.ACTIVE),
        (None, Mode.INACTIVE),
    ]
    assert all(out[r].state.rank == r and out[r].state.world_size == 4 for r in range(world))
    assert {r: leaf.state for r, leaf in trees[0].init_rank_map.items()} == {
        r: leaf.state for r, leaf in trees[3].init_rank_map.items()
    }


def _forge(store: dist.Store, rank: int, value: bytes | str) -> None:
    store.set(f"{STORE_PREFIX}/0/2/{rank}", value)


@pytest.mark.parametrize(
    ("forged", "match"),
    [
        (b"x" * (KEY_LIMIT * 4), "bytes, over"),
        (b"\xff\xfe not json", "is not JSON"),
        (b'{"initial_rank": 5, "keys": ["\\"r\\""]}', "is not"),
        (b'{"initial_rank": 1, "keys": [7]}', "is not"),
        (b'{"initial_rank": 0, "keys": ["\\"r\\""]}', "two ranks claim initial rank 0"),
        (b'{"initial_rank": 1, "keys": ["\\"elsewhere\\""]}', "same key"),
        (b"[" * 100_000, "bytes, over"),
    ],
)
def test_a_strangers_forged_entry_is_refused_with_one_line(forged: bytes, match: str) -> None:
    """A stranger who reaches the store writes rank 1's entry: rank 0 refuses it by name
    (nothing hangs, nothing half-built: a later honest call builds from scratch)."""
    store = _store()
    _forge(store, 1, forged)
    tree = Tree([Layer(key_or_fn="r")], timeout=5)
    with pytest.raises(RestartError, match=match):
        tree(_ctx(store, 0, 2))
    assert tree.init_rank_map == {}


def test_a_peer_that_never_publishes_ends_the_wait_with_its_name() -> None:
    tree = Tree([Layer()], timeout=timedelta(seconds=0.3))
    with pytest.raises(
        RestartError, match=r"ranks 1 did not publish their tree entries within 0\.3s"
    ):
        tree(_ctx(_store(), 0, 2))


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("k" * (KEY_LIMIT + 1), f"over {KEY_LIMIT}"),
        (object(), "is not JSON"),
        (float("nan"), "is not JSON"),
    ],
)
def test_a_hostile_key_of_ones_own_is_refused_before_publishing(key: object, match: str) -> None:
    store = _store()
    with pytest.raises(ValueError, match=match):
        Tree([Layer(key_or_fn=lambda s: key)])(_ctx(store, 0, 1))
    assert store.num_keys() == 0


def test_entry_parsing_is_bounded() -> None:
    ok = json.dumps({"initial_rank": 1, "keys": ['"a"', "2"]}).encode()
    assert parse_entry(ok, 1, 2, 4) == Entry(1, 1, ('"a"', "2"))
    with pytest.raises(RestartError, match="bytes, over"):
        parse_entry(b" " * (2 * (KEY_LIMIT + 8) + 65), 1, 2, 4)
    with pytest.raises(RestartError, match="is not"):
        parse_entry(
            json.dumps({"initial_rank": 1, "keys": ["a" * (KEY_LIMIT + 1), "b"]}).encode(), 1, 2, 4
        )


def test_nvidia_style_store_and_root_mismatch() -> None:
    """Through a store with NVIDIA's ``send_key``/``get_keys`` methods, as NVIDIA's tests
    drive it: ranks that disagree on the root key are refused (a ``RuntimeError``)."""

    class KeyStore:
        def __init__(self, world: int, key) -> None:  # type: ignore[no-untyped-def]
            self.states = [State(r, world) for r in range(world)]
            self.keys = [[key(r)] for r in range(world)]

        def send_state(self, state: State, rank: int) -> None: ...
        def get_states(self, ranks):  # type: ignore[no-untyped-def]
            return [self.states[r] for r in ranks]

        def send_key(self, key: object, rank: int) -> None: ...
        def get_keys(self, ranks):  # type: ignore[no-untyped-def]
            return [self.keys[r] for r in ranks]

    with pytest.raises(RuntimeError, match="same key"):
        Tree([Layer()])(_ctx(KeyStore(4, lambda r: r % 2), 0, 4))
    tree = Tree([Layer(max_ranks=3, flag=R)])
    ctx = tree(_ctx(KeyStore(4, lambda r: "x"), 0, 4))
    ctx.terminated_ranks = {0}
    with pytest.raises(RankDiscarded):
        tree(ctx)
    assert [tree.init_rank_map[r].state.active_rank for r in range(4)] == [None, 1, 2, 0]


# -- a real job --------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_a_reserve_takes_a_killed_ranks_place_in_a_gloo_job() -> None:
    """Three ranks (a program without a ``__main__`` guard), ``max_ranks=2`` under a
    ``RESERVE`` root: rank 2 waits as a reserve; rank 1 is killed in iteration 0; in
    iteration 1 rank 2 trains as rank 1 of 2 (env and ``Call`` alike)."""
    results = launch("-", world_size=3, timeout=130, program=PROGRAM)
    by_rank = {r.rank: r for r in results}
    assert by_rank[1].returncode != 0
    for rank in (0, 2):
        r = by_rank[rank]
        assert r.returncode == 0, r.output[-4000:]
        # all_reduce of the initial ranks: 0 + 2.
        assert r.of("result")[-1]["value"] == [1, 2.0], r.output[-4000:]
    placed = by_rank[2].of("assignment")
    assert [(e["rank"], e["active_rank"], e["mode"]) for e in placed] == [
        (2, None, "inactive"),
        (1, 1, "active"),
    ], by_rank[2].output[-4000:]
    entered = by_rank[2].of("enter")
    assert [(e["iteration"], e["rank"], e["world_size"], e["env"]) for e in entered] == [
        (1, 1, 2, ["1", "2"])
    ]
    assert [(e["iteration"], e["rank"], e["world_size"]) for e in by_rank[0].of("enter")] == [
        (0, 0, 2),
        (1, 0, 2),
    ]
