"""Rank assignments and filters under NVIDIA ``inprocess``'s module path
(``inprocess.rank_assignment.ShiftRanks``); defined in ``assignment``."""

from .assignment import ActiveWorldSize, FillGaps, RankAssignment, RankFilter, ShiftRanks

# NVIDIA's name for a filter that keeps at most ``n`` ranks active.
MaxActiveWorldSize = ActiveWorldSize

__all__ = [
    "ActiveWorldSize",
    "FillGaps",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankFilter",
    "ShiftRanks",
]
