"""The elastic round's close rule as a table: no store, no threads, no clock."""

from __future__ import annotations

import pytest

from stalwart.rendezvous.close_rule import (
    Close,
    CloseAction,
    CloseView,
    ElasticSettings,
    Joiner,
    TimedOut,
    Wait,
    WatchRunning,
    close_rule,
)

S = ElasticSettings(min_nodes=2, max_nodes=3, max_restarts=5, join_timeout=60, last_call_timeout=10)


def j(slot: int, hint: int | None = None, *, alive: bool = True, left: bool = False) -> Joiner:
    return Joiner(slot, f"n{slot}", hint, alive=alive, left=left)


def v(
    *joiners: Joiner,
    expected: set[str] | None = None,
    quiet: float = 0.0,
    open_for: float = 0.0,
    running: bool = False,
) -> CloseView:
    return CloseView(
        previous_running=running,
        joiners=joiners,
        expected=None if expected is None else frozenset(expected),
        quiet_for=quiet,
        open_for=open_for,
    )


@pytest.mark.parametrize(
    ("view", "want"),
    [
        # Round 0: MAX closes at once; fewer wait for last call, which needs MIN.
        (v(j(0), j(1), j(2)), Close((0, 1, 2))),
        (v(j(0), j(1)), Wait()),
        (v(j(0), j(1), quiet=9.9), Wait()),
        (v(j(0), j(1), quiet=10.0), Close((0, 1))),
        (v(j(0), quiet=99.0), Wait()),  # alone, below MIN, whatever the quiet
        # Beyond MAX: the first MAX by rank; the rest are spares.
        (v(j(0), j(1), j(2), j(3)), Close((0, 1, 2))),
        # The previous round still runs: joiners wait as spares, whatever their number.
        (v(j(0), j(1), j(2), j(3), running=True, quiet=99.0), WatchRunning()),
        # Every live member of the previous round is back (with MIN): no last call.
        (v(j(0, 1), j(1, 0), expected={"n0", "n1"}), Close((1, 0))),
        (v(j(0, 0), j(1), expected={"n0", "n5"}), Wait()),  # n5 is not back yet
        (v(j(0, 0), expected={"n0"}), Wait()),  # back, but below MIN
        # Lost or departed joiners do not count, nor take a rank.
        (v(j(0), j(1, alive=False), j(2), quiet=10.0), Close((0, 2))),
        (v(j(0), j(1, left=True), j(2, alive=False), quiet=10.0), Wait()),
        (v(j(0), j(1), j(2, left=True), j(3)), Close((0, 1, 3))),
        # Ranks: survivors keep their order (hint), newcomers follow by slot.
        (v(j(0), j(1, 2), j(2, 0), quiet=10.0), Close((2, 1, 0))),
        (v(j(0), j(1, 1), j(2), j(3, 0)), Close((3, 1, 0))),
        # Too few within the join timeout: the job cannot form.
        (v(j(0), open_for=60.1, quiet=60.1), TimedOut(1)),
        (v(j(0, alive=False), j(1), open_for=61.0), TimedOut(1)),
        (v(open_for=61.0), TimedOut(0)),
        (v(j(0), open_for=60.0), Wait()),
        # Enough at the deadline: it closes rather than fails.
        (v(j(0), j(1), open_for=70.0, quiet=10.0), Close((0, 1))),
    ],
)
def test_close_rule(view: CloseView, want: CloseAction) -> None:
    assert close_rule(view, S) == want


def test_one_node_jobs_close_alone() -> None:
    one = ElasticSettings(min_nodes=1, max_nodes=1, max_restarts=0)
    assert close_rule(v(j(0)), one) == Close((0,))
    assert close_rule(v(j(0), j(1)), one) == Close((0,))
