"""Steps seen without code: every optimizer step of a worker is a training step.

The bootstrap (cold and warm workers alike) calls `install()`. It registers torch's
process-wide optimizer post-step hook (``torch.optim.optimizer.
register_optimizer_step_post_hook``) as soon as torch is imported; torch is never
imported here. Each step then does what a program calling ``stalwart.inject.step`` and a
monitoring client's heartbeat would: it records the step for goodput
(`stalwart.progress`), beats the rank's heartbeat slot for hang detection and
stragglers, and performs any ``--inject`` fault planned for that step.

Rules (docs/monitor.md, "Progress without code"):

* A step is one ``step()`` of the *pacemaker*, the first optimizer that steps in the
  process; other optimizers' steps count for nothing (one step per iteration with a GAN's
  two optimizers, or Lightning's manual optimisation). Gradient accumulation calls
  ``step()`` once per update, so a step is an update. Another optimizer that steps twice
  while the pacemaker does not takes over (an in-process restart builds a new one; of
  two optimizers, the more frequent one paces), its second step counted.
* The count is the number of steps done: the pacemaker's own count when it keeps one
  (Adam's per-parameter ``step``, restored with a checkpoint), else one more than the
  last. A resumed attempt thus reports the steps it redoes as such.
* The program's own signals win: once it reports a step itself (``inject.step``, the
  Lightning / HF callbacks, ``RankMonitorClient.report_iteration``) the hook stops
  reporting steps; once it attaches a ``RankMonitorClient`` the slot is the client's.
* A program with no optimizer attaches nothing: it is never judged by its rhythm.
* The step torch's checkpoint API takes to create a fresh optimizer's state (zero
  gradients at learning rate 0, ``torch.distributed.checkpoint.state_dict.
  _init_optim_state``, run by ``get_state_dict`` / ``set_state_dict`` while a checkpoint is
  restored or, for a stateless optimizer, saved) trains nothing and is not a step: a
  restore before the first step is not judged by the step rhythm, and the count starts
  from the restored optimizer's own.
* ``STALWART_AUTO_PROGRESS=0`` (``stalwart run --no-auto-progress``) installs nothing.

Cost per step: a Python call, one clock read and a few stores into shared memory.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import struct
import sys
import time
import types
import weakref
from collections.abc import Sequence
from typing import Any

from stalwart import inject, progress
from stalwart.base import envvars
from stalwart.monitor import layout

log = logging.getLogger(__name__)

#: The torch module whose loading makes the hook installable.
_HOOKED_MODULE = "torch.optim.optimizer"
#: torch's function that creates an optimizer's state with a step that trains nothing.
_STATE_INIT = ("torch.distributed.checkpoint.state_dict", "_init_optim_state")
#: Frames above the optimizer's step wrapper searched for it (an LR scheduler's step
#: counter, an optimizer wrapper's own ``step`` may sit in between).
_STATE_INIT_DEPTH = 4

_monotonic = time.monotonic
_pack_i64 = layout.I64.pack_into
_pack_f64 = layout.F64.pack_into
_claims = progress.claims
# The slot's last heartbeat time and iteration are adjacent: one store writes both.
_HB_ITER = struct.Struct("=dq")
_pack_hb = _HB_ITER.pack_into
_pack_latest = progress.LATEST.pack_into
assert layout.OFF_ITERATION == layout.OFF_LAST_HB + 8


class _Pacer:
    """This process's view of the pacemaker optimizer and its slot."""

    __slots__ = (
        "buf",
        "count",
        "inject",
        "off_hb",
        "opened",
        "optimizer",
        "pbuf",
        "pid",
        "poff",
        "rival",
        "rival_steps",
    )

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.optimizer: weakref.ref[Any] | None = None
        self.count = 0
        self.opened = False
        self.buf: Any = None  # the monitor slot's mapping once attached, else None
        self.off_hb = 0
        self.pbuf: Any = None  # the progress board's mapping, else None
        self.poff = 0  # where the latest (step, time) pair of our progress slot is
        self.inject = False  # a fault is planned for this process
        self.rival = 0  # id() of another optimizer stepping while the pacemaker does not
        self.rival_steps = 0


_pacer: _Pacer | None = None
_handle: Any = None  # torch's RemovableHandle for the hook


def enabled(environ: Any = None) -> bool:
    """False when the launcher (or the user) switched the automatic step signal off."""
    env = os.environ if environ is None else environ
    return str(env.get(envvars.AUTO_PROGRESS, "1")).strip().lower() not in ("0", "false", "no")


def install() -> None:
    """Registers the hook now if torch is loaded, else as soon as it is (idempotent)."""
    if not enabled():
        return
    if _HOOKED_MODULE in sys.modules:
        _register(sys.modules[_HOOKED_MODULE])
        return
    if not any(isinstance(f, _TorchWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchWatcher())


def _register(module: types.ModuleType) -> None:
    global _handle
    if _handle is not None:
        return
    add = getattr(module, "register_optimizer_step_post_hook", None)
    if add is None:  # a torch too old to have global hooks: nothing to see steps with
        log.debug("torch has no global optimizer hooks; steps are not seen without code")
        return
    _handle = add(_on_step)


def uninstall() -> None:
    """Removes the hook (tests, and programs that want it gone)."""
    global _handle, _pacer
    if _handle is not None:
        _handle.remove()
        _handle = None
    _pacer = None
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchWatcher)]


def _after_fork() -> None:
    global _pacer
    _pacer = None


os.register_at_fork(after_in_child=_after_fork)


class _TorchWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of torch's optimizer module so that the
    hook is registered the moment that module has run."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _HOOKED_MODULE:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            original(module)
            try:
                _register(module)
            except Exception:  # never break the program's import of torch
                log.exception("could not register the optimizer step hook")

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _own_count(optimizer: Any) -> int | None:
    """The optimizer's own count of steps done (Adam and friends keep one per parameter,
    restored with a checkpoint), read once per pacemaker; None when it keeps none."""
    try:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if state and "step" in state:
                    return max(1, int(float(state["step"])))
    except Exception:  # an optimizer of unusual shape: count on from here
        return None
    return None


def _attach(pacer: _Pacer) -> None:
    """Takes this rank's monitor slot for the steps, unless a client holds it."""
    pacer.opened = True
    pacer.inject = bool(os.environ.get(envvars.INJECT))
    if not _claims.steps:
        progress.record(pacer.count)  # the attempt's first step, and where it began
    found_progress = progress.slot()
    if found_progress is not None:
        pacer.pbuf, offset = found_progress
        pacer.poff = offset + progress.LATEST_OFFSET
    if _claims.heartbeats:
        return
    try:
        found = layout.slot_from_env()
    except layout.LayoutError as exc:
        log.warning("stalwart: steps not monitored: %s", exc)
        return
    if found is None:
        return
    buf, index = found
    base = layout.slot_offset(index)
    if layout.I64.unpack_from(buf, base + layout.OFF_PID)[0] not in (0, os.getpid()):
        return  # another process of this rank writes it
    _pack_i64(buf, base + layout.OFF_PID, 0)
    buf[base : base + layout.SLOT_SIZE] = bytes(layout.SLOT_SIZE)
    _pack_i64(buf, base + layout.OFF_ITERATION, -1)
    _pack_i64(buf, base + layout.OFF_LAST_SECTION, -1)
    now = _monotonic()
    _pack_f64(buf, base + layout.OFF_ATTACH, now)
    _pack_f64(buf, base + layout.OFF_OOS_START, now)
    _pack_i64(buf, base + layout.OFF_STATE, layout.SlotState.ATTACHED)
    _pack_i64(buf, base + layout.OFF_PID, os.getpid())
    pacer.buf = buf
    pacer.off_hb = base + layout.OFF_LAST_HB


_state_init_code: types.CodeType | None = None


def _creating_state() -> bool:
    """Whether this step is torch's checkpoint API creating the optimizer's state (see
    the module's rules), from the frames above the hook (slow: `_on_step` asks only for
    a step at learning rate 0 or of an unusual shape)."""
    global _state_init_code
    code = _state_init_code
    if code is None:
        module = sys.modules.get(_STATE_INIT[0])
        if module is None:
            return False
        code = getattr(getattr(module, _STATE_INIT[1], None), "__code__", None)
        if not isinstance(code, types.CodeType):
            return False
        _state_init_code = code
    # 0: this hook, 1: torch's step wrapper that runs the hooks, 2: its caller.
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(_STATE_INIT_DEPTH):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _on_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    try:
        lr = optimizer.param_groups[0]["lr"]
    except Exception:  # an optimizer of unusual shape: the frames decide
        lr = None
    if (lr.__class__ is not float or lr == 0.0) and _creating_state():
        return
    pacer = _pacer or _new_pacer()
    ref = pacer.optimizer
    if ref is None or ref() is not optimizer:
        if not _take_over(pacer, optimizer):
            return
    else:
        pacer.rival_steps = 0
        pacer.count += 1
    step = pacer.count
    if not pacer.opened:
        _attach(pacer)
    now = _monotonic()
    buf = pacer.buf
    if buf is not None:
        if _claims.heartbeats:
            pacer.buf = None
        else:
            # No heartbeat count: the monitor counts steps by the iteration.
            _pack_hb(buf, pacer.off_hb, now, step)
    if not _claims.steps:
        pbuf = pacer.pbuf
        if pbuf is not None:
            _pack_latest(pbuf, pacer.poff, step, now)
        if pacer.inject:
            inject.at(step)


def _take_over(pacer: _Pacer, optimizer: Any) -> bool:
    """Whether `optimizer`, which is not the pacemaker, becomes it with this step: the
    first one does, and so does one that steps twice while the pacemaker does not (a
    model rebuilt by an in-process restart, or the more frequent of two optimizers)."""
    ref = pacer.optimizer
    if ref is not None and ref() is not None:
        if pacer.rival != id(optimizer):
            pacer.rival, pacer.rival_steps = id(optimizer), 0
        pacer.rival_steps += 1
        if pacer.rival_steps < 2:
            return False
    own = _own_count(optimizer)
    pacer.count = own if own is not None else pacer.count + 1
    pacer.optimizer = weakref.ref(optimizer)
    pacer.rival, pacer.rival_steps = 0, 0
    return True


def _new_pacer() -> _Pacer:
    global _pacer
    _pacer = _Pacer()
    return _pacer


def steps_seen() -> int:
    """Optimizer steps this process counted (0 before the first)."""
    return _pacer.count if _pacer is not None else 0
