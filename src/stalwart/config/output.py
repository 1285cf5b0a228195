"""Where worker output goes, as settings: ``--redirects``/``--tee`` values, the console's
rank filter and its line-prefix templates (``launch.files.logs`` acts on them)."""

from __future__ import annotations

import re
from enum import IntFlag


class Std(IntFlag):
    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    @classmethod
    def from_str(cls, value: str) -> Std | dict[int, Std]:
        """torch's spelling of `parse_std`."""
        return parse_std(value)


_VALUE = re.compile(r"^[0-3]$")
_MAP = re.compile(r"^\d+:[0-3](,\d+:[0-3])*$")


def parse_std(value: str, flag: str = "--redirects") -> Std | dict[int, Std]:
    """``"3"`` -> Std.ALL; ``"0:3,1:0"`` -> per-local-rank map; else a one-line ValueError."""
    value = value.strip()
    if _VALUE.match(value):
        return Std(int(value))
    if _MAP.match(value):
        out: dict[int, Std] = {}
        for item in value.split(","):
            rank, std = item.split(":")
            if int(rank) in out:
                raise ValueError(
                    f"{flag} {value!r}: local rank {int(rank)} is given twice "
                    "(expected each rank at most once)"
                )
            out[int(rank)] = Std(int(std))
        return out
    raise ValueError(
        f"{flag} {value!r}: expected 0..3 (0 none, 1 stdout, 2 stderr, 3 both) "
        "or a per-local-rank map like 0:3,1:0"
    )


def parse_ranks_filter(value: str) -> set[int]:
    try:
        ranks = {int(x) for x in value.split(",") if x.strip()}
    except ValueError:
        raise ValueError(
            f"--local-ranks-filter {value!r}: expected comma-separated local ranks like 0,2"
        ) from None
    if not ranks or min(ranks) < 0:
        raise ValueError(f"--local-ranks-filter {value!r}: expected non-negative local ranks")
    return ranks


# torchrun's own (role and local rank: ``[default0]:``), on one node or many; a template
# with ``${hostname}`` or ``${rank}`` is one flag away.
DEFAULT_PREFIX = "[${role_name}${local_rank}]:"
