"""Rank assignments and filters under NVIDIA ``inprocess``'s module path
(``inprocess.rank_assignment.ShiftRanks``); defined in ``assignment``."""

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

__all__ = [
    "ActiveWorldSize",
    "FillGaps",
    "FilterCountGroupedByKey",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankAssignmentCtx",
    "RankDiscarded",
    "RankFilter",
    "ShiftRanks",
]
