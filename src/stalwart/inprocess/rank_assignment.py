"""Rank assignments and filters under NVIDIA ``inprocess``'s module path
(``inprocess.rank_assignment.ShiftRanks``); defined in ``assignment`` and ``rank_tree``."""

from .assignment import (
    ActiveWorldSize,
    FillGaps,
    FilterCountGroupedByKey,
    MaxActiveWorldSize,
    RankAssignment,
    RankAssignmentCtx,
    RankFilter,
    ShiftRanks,
)
from .errors import RankDiscarded
from .rank_tree import Layer, LayerFlag, Tree

__all__ = [
    "ActiveWorldSize",
    "FillGaps",
    "FilterCountGroupedByKey",
    "Layer",
    "LayerFlag",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankAssignmentCtx",
    "RankDiscarded",
    "RankFilter",
    "ShiftRanks",
    "Tree",
]
