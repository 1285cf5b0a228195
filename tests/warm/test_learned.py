"""The learned-preload decisions, as tables."""

from __future__ import annotations

import pytest

from stalwart.launch.workers.zygote import (
    HIGH_FD,
    SETTLE_S,
    learn_fd_floor,
    learned_modules,
    report_due,
)

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    ("elapsed", "quiet", "count", "reported", "due"),
    [
        (0.5, 0.5, 900, 800, False),  # too early: the program is still importing
        (SETTLE_S + 1, 0.2, 900, 800, False),  # a module arrived just now
        (SETTLE_S + 1, SETTLE_S, 900, 800, True),  # settled, and more than last time
        (30.0, 10.0, 900, 900, False),  # nothing new since the last report
        (30.0, 10.0, 950, 900, True),  # the first steps imported more
    ],
)
def test_report_due(elapsed: float, quiet: float, count: int, reported: int, due: bool) -> None:
    assert report_due(elapsed, quiet, count, reported) is due


def test_learned_modules_keeps_new_libraries_in_import_order() -> None:
    mods = [
        ("torch", "/site/torch/__init__.py"),  # the template has it
        ("__main__", "/job/train.py"),
        ("lightning", "/site/lightning/__init__.py"),
        ("sys", None),  # built in: nothing to import from a file
        ("model", "/job/model.py"),  # the program's own code: read afresh on restart
        ("model.layers", "/job/model/layers.py"),
        ("jobby", "/jobby/x.py"),  # a sibling folder whose name starts alike is not own
        ("lightning.pytorch", "/site/lightning/pytorch/__init__.py"),
    ]
    got = learned_modules(mods, known={"torch"}, own_dirs=["/job"])
    assert got == ["lightning", "jobby", "lightning.pytorch"]


@pytest.mark.parametrize(
    ("soft", "floor"),
    [
        (-1, HIGH_FD),  # unlimited
        (1 << 20, HIGH_FD),
        (2 * HIGH_FD, HIGH_FD),
        (1024, 512),  # the usual default: half of it, the program keeps the rest
        (512, 256),
        (256, None),  # so few that any number it could take is one programs use
        (64, None),
    ],
)
def test_learn_fd_floor(soft: int, floor: int | None) -> None:
    assert learn_fd_floor(soft) == floor
