"""Restoring into the caller's tensors (``restore(into=...)``): which tensor goes where.

A restarted job has usually built its model and optimizer before it restores. Copying
the checkpoint straight into those tensors skips allocating (and, on a VM, faulting in)
a second copy of the state, which measured as most of a restore from RAM.

:func:`bind` pairs a loaded state with the one the caller gives, by position: the same
keys of dicts, the same indices of lists and tuples. It only decides; the copying is
the caller's (from the launcher's memory in ``ram``, from a loaded file in ``resume``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


class StateMismatchError(ValueError):
    """A tensor given to restore into differs in shape or dtype from the checkpoint's."""


@dataclass(frozen=True)
class Pair:
    """The loaded tensor at ``path`` and the caller's tensor at the same place."""

    path: str
    loaded: torch.Tensor
    into: torch.Tensor


def key_path(keys: tuple[Any, ...]) -> str:
    """How an error names a place in a state dict: ``['model']['0.weight']``."""
    return "".join(f"[{k!r}]" for k in keys) or "the state itself"


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"


def bind(loaded: Any, into: Any) -> tuple[Any, list[Pair]]:
    """``loaded`` with each tensor replaced by the caller's at the same place, and the pairs.

    ``loaded`` must be a structure this process just built (it is changed in place:
    dicts and lists get the caller's tensors, tuples are rebuilt). Tensors without a
    counterpart in ``into`` stay as loaded; tensors of ``into`` without a counterpart in
    ``loaded`` are not part of the result. Every pair is checked before this returns:
    a counterpart of another shape or dtype raises :class:`StateMismatchError` (one
    line naming the place) and nothing has been copied yet. The device may differ.
    """
    pairs: list[Pair] = []
    result = _bind(loaded, into, (), pairs)
    return result, pairs


def _bind(loaded: Any, into: Any, keys: tuple[Any, ...], pairs: list[Pair]) -> Any:
    if isinstance(loaded, torch.Tensor):
        if not isinstance(into, torch.Tensor):
            return loaded
        if into.dtype != loaded.dtype or into.shape != loaded.shape:
            raise StateMismatchError(
                f"cannot restore {key_path(keys)} in place: the checkpoint holds "
                f"{_describe(loaded)}, the tensor given is {_describe(into)}"
            )
        pairs.append(Pair(key_path(keys), loaded, into))
        return into
    # Only the containers a state dict is made of: a custom class (weights_only=False)
    # keeps its tensors as loaded, they are copied from the checkpoint as a whole.
    if type(loaded) in (dict, OrderedDict):
        given = into if isinstance(into, Mapping) else {}
        for k, v in loaded.items():
            loaded[k] = _bind(v, given.get(k), (*keys, k), pairs)
        return loaded
    if type(loaded) is list:
        given_list = into if isinstance(into, list | tuple) else ()
        for i, v in enumerate(loaded):
            loaded[i] = _bind(v, given_list[i] if i < len(given_list) else None, (*keys, i), pairs)
        return loaded
    if type(loaded) is tuple:
        given_tuple = into if isinstance(into, list | tuple) else ()
        return tuple(
            _bind(v, given_tuple[i] if i < len(given_tuple) else None, (*keys, i), pairs)
            for i, v in enumerate(loaded)
        )
    return loaded


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether copying into ``a`` and into ``b`` writes the very same bytes."""
    return (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def copy_pairs(pairs: list[Pair], threads: int = 1) -> None:
    """Copy each pair's loaded tensor into the caller's (a file's state, already loaded)."""
    from .staging import _run_copies

    jobs = [(p.into, p.loaded) for p in pairs if not same_memory(p.into, p.loaded)]
    _run_copies(jobs, threads)
