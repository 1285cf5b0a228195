"""Reading a settings file a user names (`stalwart run --config`, NVIDIA's FT config):
YAML's safe loader over a bounded regular file, its data bounded too.

A YAML alias is a reference, so a few hundred bytes of nested aliases (the "billion
laughs") load as a small shared structure that expands to billions of values wherever
it is walked, printed or compared; a self-referencing one never ends. Both are refused
here, once, before any caller walks the data.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

#: Largest file read: a training config is a few KiB; anything near this is not a
#: config, and YAML's parser would hold all of it in memory.
MAX_YAML_BYTES = 1024 * 1024
#: Most values the data may hold with every alias expanded: written out, each value
#: takes at least one byte, so no file within MAX_YAML_BYTES reaches this without aliases.
MAX_YAML_VALUES = MAX_YAML_BYTES


def read_yaml(path: Path) -> Any:
    """The data of the YAML file at `path`: a regular file of at most MAX_YAML_BYTES,
    without Python tags, nesting beyond the interpreter's recursion limit, or aliases
    that expand past MAX_YAML_VALUES or refer to themselves. Anything else is a
    ValueError in one line that starts with the path (OSError as the open raised it)."""
    import yaml

    # O_NONBLOCK: a FIFO planted at the path must not block the open.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        raw = f.read(MAX_YAML_BYTES + 1)
    if len(raw) > MAX_YAML_BYTES:
        raise ValueError(f"{path}: larger than {MAX_YAML_BYTES} bytes; not a config file")
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        # YAML's messages span lines (a caret under the problem): one line here.
        raise ValueError(f"{path}: cannot read YAML ({' '.join(str(err).split())})") from None
    except RecursionError:
        raise ValueError(f"{path}: YAML nested too deeply") from None
    why = too_large(data, MAX_YAML_VALUES)
    if why is not None:
        raise ValueError(f"{path}: {why}")
    return data


def _children(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [*node.keys(), *node.values()]
    if isinstance(node, list | tuple | set | frozenset):
        return list(node)
    return []


def too_large(data: Any, limit: int) -> str | None:
    """Why `data` (as a YAML loader builds it) is refused, or None: more than `limit`
    values with shared containers counted each time they are referred to, or a
    container that holds itself. Each container is visited once, so this costs what
    the file holds, not what it expands to."""
    sizes: dict[int, int] = {}  # container id -> values it expands to, itself included
    open_: set[int] = set()  # containers whose children are still being counted
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        node, counted = stack.pop()
        kids = _children(node)
        if not kids and not isinstance(node, dict | list | tuple | set | frozenset):
            continue
        key = id(node)
        if counted:
            total = 1 + sum(sizes.get(id(k), 1) for k in kids)
            if total > limit:
                return f"YAML aliases expand to more than {limit} values; not a config file"
            sizes[key] = total
            open_.discard(key)
            continue
        if key in sizes:
            continue
        if key in open_:
            return "a YAML alias refers to a value that holds it; expected plain data"
        open_.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in sizes)
    return None
