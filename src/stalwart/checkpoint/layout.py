"""Names and places of things inside a checkpoint directory.

::

    <root>/
      step_000000100/
        rank_0.pt              # a plain torch.save file
        rank_0.manifest.json   # names rank_0.pt with its size + checksum; written last
        rank_1.<token>.pt      # a re-saved share gets a fresh name (see writer.py)
        rank_1.pt
        rank_1.manifest.json
      latest -> step_000000100 # symlink, moved only to a step every rank finished
      .tmp-...                 # in-progress or abandoned work, never read

A rank's share of a step exists once its manifest exists; a step is complete
once the manifests of all ``world_size`` ranks exist. The manifest names the
data file it vouches for, so a re-save can write its data under a fresh name
beside the old one and switch with a single rename of the manifest.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path

LATEST = "latest"
TMP_PREFIX = ".tmp-"
_STEP_RE = re.compile(r"^step_(\d+)$")
_DATA_RE = re.compile(r"^rank_(\d+)(?:\.[0-9a-f]{1,32})?\.pt$")


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:09d}"


def step_dir(root: Path, step: int) -> Path:
    return root / step_dir_name(step)


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def data_name(rank: int) -> str:
    return f"rank_{rank}.pt"


def manifest_name(rank: int) -> str:
    return f"rank_{rank}.manifest.json"


def is_data_name(name: str, rank: int) -> bool:
    """Whether ``name`` is a data file name rank ``rank``'s writer may have chosen."""
    m = _DATA_RE.match(name)
    return m is not None and int(m.group(1)) == rank


def next_data_name(rank: int, present: Collection[str], token: str) -> str:
    """The name a new data file of ``rank`` gets in a step folder holding ``present``.

    The plain ``rank_r.pt`` when it is free (a first save: the name users and
    ``torch.load("<dir>/latest/rank_0.pt")`` expect), else a fresh name, so a
    re-save never overwrites the file the current manifest vouches for.
    """
    plain = data_name(rank)
    if plain not in present:
        return plain
    return f"rank_{rank}.{token}.pt"


def tmp_dir_name(step: int, rank: int, token: str) -> str:
    return f"{TMP_PREFIX}{step_dir_name(step)}-rank_{rank}-{token}"


def tmp_glob_for_rank(rank: int) -> str:
    return f"{TMP_PREFIX}step_*-rank_{rank}-*"


def list_steps(root: Path) -> list[int]:
    """Steps that have a folder under ``root``, newest first (complete or not)."""
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    steps = []
    for entry in entries:
        step = parse_step(entry.name)
        if step is not None and entry.is_dir() and not entry.is_symlink():
            steps.append(step)
    return sorted(steps, reverse=True)


def ranks_committed(folder: Path) -> set[int]:
    """Ranks whose manifest is present in a step folder."""
    ranks: set[int] = set()
    try:
        names = [p.name for p in folder.iterdir()]
    except FileNotFoundError:
        return ranks
    for name in names:
        m = re.match(r"^rank_(\d+)\.manifest\.json$", name)
        if m:
            ranks.add(int(m.group(1)))
    return ranks


def is_complete(folder: Path, world_size: int) -> bool:
    return ranks_committed(folder).issuperset(range(world_size))


def read_latest(root: Path) -> int | None:
    """Step the ``latest`` pointer names, or None when absent or unreadable."""
    try:
        target = (root / LATEST).readlink()
    except OSError:
        return None
    return parse_step(target.name)
