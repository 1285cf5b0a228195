"""The writer process's settings and the two ways to build a ``CheckpointProcess``.

torch's experimental ``CheckpointProcess(rank_info, config, subprocess_init_fn,
subprocess_init_args, checkpoint_writer_init_fn, checkpoint_writer_init_args)`` and
stalwart's keyword form (``writer_factory=``, ``writer_kwargs=``, ``init_fn=``...) both
resolve here to one ``ProcessSpec``; ``process.py`` runs it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .identity import current_rank_info


@dataclass(frozen=True, kw_only=True)
class WriterProcessConfig:
    """Timeouts and sizing of the writer subprocess.  ``CheckpointerConfig`` extends it,
    so each of these settings is declared here only."""

    init_timeout_s: float = 60.0
    shutdown_timeout_s: float = 30.0
    # None: a write may take as long as the disk needs. Otherwise a write still
    # running after this long gets its child killed and fails with TimeoutError.
    write_timeout_s: float | None = None
    copy_threads: int = 1
    # Size the staging buffer at start-up, off the training thread, so even the
    # first write only copies. 0: sized by the first write.
    reserve_bytes: int = 0
    log_level: int = logging.WARNING
    # Added to the writer's nice value: it then runs on spare cycles and the
    # training processes win any contention for a core (a large value starves it
    # on a busy host; 0 turns it off).
    writer_nice: int = 5


# The DCP shard writer's nice value when no WriterProcessConfig is given. Measured
# (bench/bench_dcp_parts.py, 256 MiB, a one-thread loop running, load 26-31 on 2
# cores): at +5 the save took 11.6 s to durable and slowed the loop's steps 1.55x
# while it ran; at 0, 6.6 s and 2.26x: about the same loop steps lost in all (the
# writer's CPU work is the same), the step durable in half the time.
DCP_WRITER_NICE = 0


@dataclass
class CheckpointProcessConfig:
    """torch's experimental ``CheckpointProcessConfig``, field for field; the process
    turns it into a :class:`WriterProcessConfig` (other settings at their defaults)."""

    subprocess_init_timeout_secs: int = 30
    subprocess_shutdown_timeout_secs: int = 60

    def to_writer_config(self) -> WriterProcessConfig:
        return WriterProcessConfig(
            init_timeout_s=float(self.subprocess_init_timeout_secs),
            shutdown_timeout_s=float(self.subprocess_shutdown_timeout_secs),
        )


@dataclass(frozen=True)
class ProcessSpec:
    """What a :class:`CheckpointProcess` was asked to run, whichever form built it."""

    writer_factory: Callable[..., Any]
    writer_kwargs: dict[str, Any]
    init_fn: Callable[..., None] | None
    init_args: tuple[Any, ...]
    config: WriterProcessConfig


# torch's CheckpointProcess.__init__, in its positional order.
_TORCH_PARAMS = (
    "rank_info",
    "config",
    "subprocess_init_fn",
    "subprocess_init_args",
    "checkpoint_writer_init_fn",
    "checkpoint_writer_init_args",
)
_STALWART_PARAMS = ("writer_factory", "writer_kwargs")
_STALWART_KEYWORDS = ("init_fn", "init_args", "config", "rank_info")


def _is_rank_info(value: Any) -> bool:
    return hasattr(value, "global_rank") and hasattr(value, "global_world_size")


def _accepts_rank_info(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return "rank_info" in params


def _as_config(value: Any) -> WriterProcessConfig:
    if value is None:
        return WriterProcessConfig()
    if isinstance(value, WriterProcessConfig):
        return value
    if isinstance(value, CheckpointProcessConfig):
        return value.to_writer_config()
    if hasattr(value, "subprocess_init_timeout_secs"):  # torch's own config class
        return CheckpointProcessConfig(
            value.subprocess_init_timeout_secs, value.subprocess_shutdown_timeout_secs
        ).to_writer_config()
    raise TypeError(
        f"config={value!r}: expected a WriterProcessConfig or a CheckpointProcessConfig"
    )


def resolve_process_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> ProcessSpec:
    """Read either constructor form of :class:`CheckpointProcess`.

    torch's form, ``(rank_info, config, subprocess_init_fn, subprocess_init_args,
    checkpoint_writer_init_fn, checkpoint_writer_init_args)`` (positional or by
    name), is recognised by a rank-info first argument or by its keyword names.
    Like torch, it adds ``rank_info`` to the writer's init arguments unless they
    already hold one. stalwart's form is ``(writer_factory, writer_kwargs=None, *,
    init_fn=None, init_args=(), config=None, rank_info=None)``; there ``rank_info``
    is passed only when given, or when the factory names a ``rank_info``
    parameter (then taken from RANK/WORLD_SIZE or the process group).
    """
    torch_form = (bool(args) and _is_rank_info(args[0])) or any(
        k in kwargs for k in _TORCH_PARAMS if k not in ("rank_info", "config")
    )
    if torch_form and args and not _is_rank_info(args[0]):
        torch_names = sorted(k for k in kwargs if k in _TORCH_PARAMS)
        raise TypeError(
            f"CheckpointProcess got {args[0]!r} first and torch's {', '.join(torch_names)}: "
            "pass either (writer_factory, writer_kwargs, ...) or torch's (rank_info, config, ...)"
        )
    names = _TORCH_PARAMS if torch_form else _STALWART_PARAMS
    if len(args) > len(names):
        raise TypeError(
            f"CheckpointProcess takes at most {len(names)} positional arguments "
            f"({', '.join(names)}), got {len(args)}"
        )
    given = dict(zip(names, args, strict=False))
    allowed = set(names) | ({"config"} if torch_form else set(_STALWART_KEYWORDS))
    for key, value in kwargs.items():
        if key not in allowed:
            form = "torch's (rank_info, ...)" if torch_form else "stalwart's (writer_factory, ...)"
            raise TypeError(
                f"CheckpointProcess got an unexpected argument {key!r} for {form} form; "
                f"expected one of {sorted(allowed)}"
            )
        if key in given:
            raise TypeError(f"CheckpointProcess got two values for {key!r}")
        given[key] = value
    if torch_form:
        missing = [n for n in ("rank_info", "checkpoint_writer_init_fn") if n not in given]
        if missing:
            raise TypeError(f"CheckpointProcess (torch's form) needs {', '.join(missing)}")
        factory = given["checkpoint_writer_init_fn"]
        writer_kwargs = dict(given.get("checkpoint_writer_init_args") or {})
        init_fn = given.get("subprocess_init_fn")
        init_args = tuple(given.get("subprocess_init_args") or ())
        rank_info: Any = given["rank_info"]
    else:
        if "writer_factory" not in given:
            raise TypeError("CheckpointProcess needs writer_factory (or torch's rank_info, ...)")
        factory = given["writer_factory"]
        writer_kwargs = dict(given.get("writer_kwargs") or {})
        init_fn = given.get("init_fn")
        init_args = tuple(given.get("init_args") or ())
        rank_info = given.get("rank_info")
        if rank_info is None and _accepts_rank_info(factory):
            rank_info = current_rank_info()
    if not callable(factory):
        raise TypeError(f"writer factory {factory!r} is not callable")
    if rank_info is not None and "rank_info" not in writer_kwargs:
        writer_kwargs["rank_info"] = rank_info
    return ProcessSpec(factory, writer_kwargs, init_fn, init_args, _as_config(given.get("config")))
