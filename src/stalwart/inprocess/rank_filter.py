"""Rank filters under NVIDIA ``inprocess``'s module path (``inprocess.rank_filter``);
defined in ``assignment``."""

from .assignment import ActiveWorldSize, MaxActiveWorldSize, RankFilter, WorldSizeDivisibleBy

__all__ = ["ActiveWorldSize", "MaxActiveWorldSize", "RankFilter", "WorldSizeDivisibleBy"]
