"""CheckpointProcess's two constructor forms (stalwart's and torch's) and the writer
call convention, as tables over the pure functions; one real child for the error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import ScriptedWriter

from stalwart.checkpoint import (
    CheckpointError,
    CheckpointProcess,
    CheckpointProcessConfig,
    RankInfo,
    WriterError,
    WriterProcessConfig,
)
from stalwart.checkpoint.child import write_call_style
from stalwart.checkpoint.process_args import resolve_process_args


class _TorchStyle:
    def __init__(self, rank_info: RankInfo, out: str = "") -> None:
        self.rank_info = rank_info

    def write(self, path: str, state_dict: Any, **kwargs: Any) -> None: ...


def _init(*_: Any) -> None: ...


RI = RankInfo(global_rank=3, global_world_size=8)
CFG = CheckpointProcessConfig(subprocess_init_timeout_secs=5, subprocess_shutdown_timeout_secs=7)
WCFG = WriterProcessConfig(init_timeout_s=9.0)

# (args, kwargs) -> (factory, writer_kwargs, init_fn, init_args, init timeout, shutdown timeout)
CASES: list[tuple[str, tuple[Any, ...], dict[str, Any], tuple[Any, ...]]] = [
    (
        "torch positional",
        (RI, CFG, _init, ("a",), _TorchStyle, {"out": "x"}),
        {},
        (_TorchStyle, {"out": "x", "rank_info": RI}, _init, ("a",), 5.0, 7.0),
    ),
    (
        "torch keywords",
        (),
        dict(
            rank_info=RI,
            config=CFG,
            subprocess_init_fn=_init,
            subprocess_init_args=(),
            checkpoint_writer_init_fn=_TorchStyle,
            checkpoint_writer_init_args={},
        ),
        (_TorchStyle, {"rank_info": RI}, _init, (), 5.0, 7.0),
    ),
    (
        "torch: a rank_info already in the init args wins, as in torch",
        (RI, None, None, (), _TorchStyle, {"rank_info": "mine"}),
        {},
        (_TorchStyle, {"rank_info": "mine"}, None, (), 60.0, 30.0),
    ),
    (
        "stalwart positional, factory without rank_info",
        (ScriptedWriter, {"out_dir": "d"}),
        {"config": WCFG},
        (ScriptedWriter, {"out_dir": "d"}, None, (), 9.0, 30.0),
    ),
    (
        "stalwart, factory naming rank_info gets it from RANK/WORLD_SIZE",
        (_TorchStyle,),
        {"init_fn": _init, "init_args": (1,)},
        (_TorchStyle, {"rank_info": RankInfo(2, 4)}, _init, (1,), 60.0, 30.0),
    ),
    (
        "stalwart with an explicit rank_info and torch's config class",
        (ScriptedWriter, {"out_dir": "d"}),
        {"rank_info": RI, "config": CFG},
        (ScriptedWriter, {"out_dir": "d", "rank_info": RI}, None, (), 5.0, 7.0),
    ),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("name", "args", "kwargs", "expected"), CASES, ids=[c[0] for c in CASES])
def test_constructor_forms(
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    expected: tuple[Any, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    spec = resolve_process_args(args, kwargs)
    got = (
        spec.writer_factory,
        spec.writer_kwargs,
        spec.init_fn,
        spec.init_args,
        spec.config.init_timeout_s,
        spec.config.shutdown_timeout_s,
    )
    assert got == expected


BAD: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [
    ((), {}, "needs writer_factory"),
    ((RI, CFG), {}, "needs checkpoint_writer_init_fn"),
    ((ScriptedWriter, {}, 1), {}, "at most 2 positional"),
    ((ScriptedWriter,), {"subprocess_init_fn": _init}, "pass either"),
    ((ScriptedWriter,), {"init": _init}, "unexpected argument 'init'"),
    ((ScriptedWriter,), {"config": 5}, "config=5: expected a WriterProcessConfig"),
    (("not callable",), {}, "is not callable"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("args", "kwargs", "message"), BAD)
def test_bad_constructor_arguments_are_one_line_type_errors(
    args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(TypeError, match=message) as info:
        resolve_process_args(args, kwargs)
    assert "\n" not in str(info.value)


def _w_torch(self: Any, path: str, state_dict: Any, **kwargs: Any) -> None: ...
def _w_stalwart(self: Any, state_dict: Any, path: str, *, release: Any, **kw: Any) -> None: ...
def _w_kwargs_only(self: Any, **kwargs: Any) -> None: ...
def _w_positional_only(self: Any, path: str, state_dict: Any, /, **kwargs: Any) -> None: ...
def _w_other_names(self: Any, state: Any, target: str) -> None: ...


STYLES: list[tuple[Callable[..., Any], bool | None]] = [
    (_w_torch, False),
    (_w_stalwart, True),
    (_w_kwargs_only, False),
    (_w_positional_only, None),
    (_w_other_names, None),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("write", "takes_release"), STYLES)
def test_write_call_style(write: Callable[..., Any], takes_release: bool | None) -> None:
    bound = write.__get__(object())
    if takes_release is None:
        with pytest.raises(TypeError, match=r"does not take (path|state_dict)= by keyword"):
            write_call_style(bound)
    else:
        assert write_call_style(bound) is takes_release


class PositionalWriter:
    def write(self, state: Any, target: str) -> None: ...


@pytest.mark.timeout(60)
def test_writer_that_cannot_take_keywords_fails_at_start_as_runtime_error(
    tmp_path: Path,
) -> None:
    proc = CheckpointProcess(PositionalWriter)
    try:
        with pytest.raises(RuntimeError, match="does not take path= by keyword") as info:
            proc.wait_ready(timeout=60)
        assert isinstance(info.value, WriterError) and isinstance(info.value, CheckpointError)
    finally:
        proc.close()
