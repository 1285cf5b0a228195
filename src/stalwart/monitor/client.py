"""Rank side of heartbeat and section monitoring: `RankMonitorClient`.

Every call on the hot path is a `time.monotonic()` and one or two `struct.pack_into`
stores into this rank's slot of the node's shared-memory segment: no syscall, no
message. The client also keeps the longest intervals it has seen, from which
`calculate_and_set_*_timeouts` derive learned timeouts agreed by all ranks.

Outside a stalwart launcher (no STALWART_MONITOR_SHM), `init_workload_monitoring`
logs one warning and the client writes into a private buffer: monitoring calls are
harmless no-ops. Set STALWART_MONITOR_STRICT=1 (or strict=True) to get an error instead.
Workload control requests cannot be honoured without a launcher and always raise there.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import multiprocessing.util
import os
import sys
import time
import types
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from stalwart import progress
from stalwart.base import envvars as base_env
from stalwart.monitor import envvars, layout, nvidia_server, stacks
from stalwart.monitor.learned import (
    NVIDIA_STATE_KEY,
    STATE_KEY,
    LearnedTimeouts,
    Observations,
    from_nvidia_state,
    gather_json,
    merge_max,
)
from stalwart.monitor.pipe import PipeError, PipeWriter
from stalwart.monitor.reports import ControlAction
from stalwart.monitor.timeouts_in_force import Configured, HeartbeatTimeouts, SectionTimeouts
from stalwart.monitor.wire import ControlMessage, encode

log = logging.getLogger(__name__)

_monotonic = time.monotonic
_pack_f64 = layout.F64.pack_into
_pack_i64 = layout.I64.pack_into


def _ema(old: float, new: float) -> float:
    """NVIDIA's merge of a new timeout estimate into a learned one (alpha 0.5)."""
    return 0.5 * old + 0.5 * new


class RankMonitorError(RuntimeError):
    """Misuse of the client (not initialised, section opened twice, ...)."""


#: NVIDIA's name for the same error, so `except RankMonitorClientError` works unchanged.
RankMonitorClientError = RankMonitorError


class RankMonitorClient:
    """One per rank process. Call `init_workload_monitoring()` before anything else.

    store: a torch.distributed Store used to agree on learned timeouts when no default
        process group is up (the launcher's job store is found on its own).
    strict: raise instead of warning when no node monitor is configured
        (default: STALWART_MONITOR_STRICT=1).
    install_exception_hook: chain sys.excepthook to record the exception and close sections.
    install_stack_dump: register the stack dump at init (see `stacks.install`).
    safety_factor: learned timeout = longest observed interval x this (default: the
        `safety_factor` of the FaultToleranceConfig a RankMonitorServer was started
        with, when the rank attaches to one; else the node's, from
        STALWART_MONITOR_SAFETY_FACTOR; else 5).
    """

    def __init__(
        self,
        *,
        store: Any | None = None,
        strict: bool | None = None,
        install_exception_hook: bool = False,
        install_stack_dump: bool = True,
        safety_factor: float | None = None,
    ) -> None:
        self.store = store
        self.strict = os.environ.get(envvars.STRICT) == "1" if strict is None else strict
        self.install_exception_hook = install_exception_hook
        self.install_stack_dump = install_stack_dump
        self._factor_given = safety_factor is not None
        if safety_factor is None:
            safety_factor = float(os.environ.get(envvars.SAFETY_FACTOR, "5.0"))
        if safety_factor < 1:
            raise ValueError(f"safety_factor must be >= 1, got {safety_factor}")
        self.safety_factor = safety_factor
        self.learned = LearnedTimeouts()
        self._configured = Configured.from_env()
        self.last_exception: str | None = None
        self.active = False  # True when a node monitor actually reads our slot
        self._buf: mmap.mmap | bytearray | None = None
        self._slot = 0
        self._base = 0
        self._off_hb = 0
        self._off_iter = 0
        self._off_beats = 0
        self._beats = 0
        self._off_open = 0
        self._off_oos = 0
        self._off_last = 0
        self._index: dict[str, int] = {}
        self._names: list[str] = []
        self._opened: list[float] = [0.0] * layout.MAX_SECTIONS
        self._longest: list[float] = [0.0] * layout.MAX_SECTIONS
        self._n_open = 0
        self._attach_time = 0.0
        self._last_hb = 0.0
        self._first_hb_gap: float | None = None
        self._max_hb_gap = 0.0
        self._oos_since = 0.0
        self._max_oos = 0.0
        self._sync_seq = 0
        self._pipe: PipeWriter | None = None
        self._prev_hook: Any = None

    # -- lifecycle -------------------------------------------------------------------
    def init_workload_monitoring(self) -> None:
        if self._buf is not None:
            raise RankMonitorError("init_workload_monitoring() was already called")
        found = layout.slot_from_env()
        nvidia_path = os.environ.get(envvars.NVIDIA_IPC_SOCKET)
        if found is None and nvidia_path:
            # A monitor process started with NVIDIA's RankMonitorServer.run_in_subprocess.
            try:
                segment, self._configured, factor = nvidia_server.attach(nvidia_path)
            except (OSError, ValueError, layout.LayoutError) as exc:
                raise RankMonitorError(
                    f"{envvars.NVIDIA_IPC_SOCKET}={nvidia_path!r}: no usable rank monitor "
                    f"there ({exc})"
                ) from None
            found = (segment, 0)
            if factor is not None and not self._factor_given:
                self.safety_factor = factor
            # NVIDIA's monitor stops watching a rank whose connection closed; here the
            # rank says so as it exits, so a slow interpreter teardown is no hang. A
            # multiprocessing child skips atexit, hence its finalizer too.
            atexit.register(self.shutdown_workload_monitoring)
            multiprocessing.util.Finalize(None, self.shutdown_workload_monitoring, exitpriority=100)
        if found is None:
            msg = (
                f"stalwart monitor: {envvars.SHM_FILE} is not set (not started by `stalwart run`?); "
                "heartbeats and sections are not monitored"
            )
            if self.strict:
                raise RankMonitorError(msg)
            log.warning(msg)
            self._buf, index = bytearray(layout.segment_size(1)), 0
        else:
            self._buf, index = found
            self.active = True
            # The slot is ours now: the automatic step signal stops beating it.
            progress.claim_heartbeats()
        self._slot = index
        self._base = base = layout.slot_offset(index)
        self._off_hb = base + layout.OFF_LAST_HB
        self._off_iter = base + layout.OFF_ITERATION
        self._off_beats = base + layout.OFF_BEATS
        self._beats = 0
        self._off_open = base + layout.OFF_OPEN
        self._off_oos = base + layout.OFF_OOS_START
        self._off_last = base + layout.OFF_LAST_SECTION
        buf = self._buf
        # Hide the slot from the scanner (pid 0) while rewriting it.
        _pack_i64(buf, base + layout.OFF_PID, 0)
        buf[base : base + layout.SLOT_SIZE] = bytes(layout.SLOT_SIZE)
        _pack_i64(buf, self._off_iter, -1)
        _pack_i64(buf, self._off_last, -1)
        now = _monotonic()
        self._attach_time = self._oos_since = now
        _pack_f64(buf, base + layout.OFF_ATTACH, now)
        _pack_f64(buf, self._off_oos, now)
        self._index.clear()
        self._names.clear()
        self._opened = [0.0] * layout.MAX_SECTIONS
        self._longest = [0.0] * layout.MAX_SECTIONS
        self._n_open = 0
        self._last_hb = 0.0
        self._first_hb_gap = None
        self._max_hb_gap = self._max_oos = 0.0
        self._write_learned()
        _pack_i64(buf, base + layout.OFF_STATE, layout.SlotState.ATTACHED)
        _pack_i64(buf, base + layout.OFF_PID, os.getpid())
        if self.install_stack_dump and self.active:
            stacks.install()
        if self.install_exception_hook:
            self._hook_exceptions()

    def shutdown_workload_monitoring(self) -> None:
        """Stops monitoring of this rank (a clean exit is not a hang)."""
        if self._buf is None:
            return
        _pack_i64(self._buf, self._base + layout.OFF_STATE, layout.SlotState.DETACHED)
        self._buf = None
        self.active = False
        if self._pipe is not None:
            self._pipe.close()
        if self._prev_hook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_hook
            self._prev_hook = None

    def _ready(self) -> mmap.mmap | bytearray:
        if self._buf is None:
            raise RankMonitorError("call init_workload_monitoring() first")
        return self._buf

    # -- hot path --------------------------------------------------------------------
    def send_heartbeat(self) -> None:
        buf = self._buf
        if buf is None:
            raise RankMonitorError("call init_workload_monitoring() first")
        now = _monotonic()
        last = self._last_hb
        if last:
            gap = now - last
            if gap > self._max_hb_gap:
                self._max_hb_gap = gap
        else:
            self._first_hb_gap = now - self._attach_time
        self._last_hb = now
        self._beats += 1
        # The count first: a scan that sees the new time also sees at least this count.
        _pack_i64(buf, self._off_beats, self._beats)
        _pack_f64(buf, self._off_hb, now)

    def report_iteration(self, iteration: int) -> None:
        buf = self._buf
        if buf is None:
            raise RankMonitorError("call init_workload_monitoring() first")
        _pack_i64(buf, self._off_iter, iteration)
        # The launcher's goodput accounting reads the step from its own slot.
        progress.report(iteration)

    def start_section(self, section: str) -> None:
        """Opens `section` (NVIDIA's parameter name). Sections may nest or overlap; one
        name cannot be open twice."""
        name = section
        buf = self._buf
        if buf is None:
            raise RankMonitorError("call init_workload_monitoring() first")
        idx = self._index.get(name)
        if idx is None:
            idx = self._register(name)
        if self._opened[idx]:
            raise RankMonitorError(f"section {name!r} is already open")
        now = _monotonic()
        if not self._n_open:
            gap = now - self._oos_since
            if gap > self._max_oos:
                self._max_oos = gap
        self._opened[idx] = now
        self._n_open += 1
        _pack_f64(buf, self._off_open + 8 * idx, now)
        _pack_i64(buf, self._off_last, idx)

    def end_section(self, section: str) -> None:
        name = section
        buf = self._buf
        if buf is None:
            raise RankMonitorError("call init_workload_monitoring() first")
        idx = self._index.get(name)
        opened = self._opened[idx] if idx is not None else 0.0
        if not opened or idx is None:
            raise RankMonitorError(f"section {name!r} is not open")
        now = _monotonic()
        if now - opened > self._longest[idx]:
            self._longest[idx] = now - opened
        self._opened[idx] = 0.0
        self._n_open -= 1
        if not self._n_open:
            # Written before the section closes, so a scan never pairs "nothing open"
            # with an old out-of-section start.
            self._oos_since = now
            _pack_f64(buf, self._off_oos, now)
        _pack_f64(buf, self._off_open + 8 * idx, 0.0)

    def end_all_sections(self) -> None:
        self._ready()
        for name in [n for i, n in enumerate(self._names) if self._opened[i]]:
            self.end_section(name)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.start_section(name)
        try:
            yield
        finally:
            self.end_section(name)

    def register_sections(self, names: Collection[str]) -> None:
        """Reserves slots for `names` up front so the first start_section is as cheap as later ones."""
        self._ready()
        for name in names:
            if name not in self._index:
                self._register(name)

    def _register(self, name: str) -> int:
        buf = self._ready()
        if not isinstance(name, str) or not name:
            raise RankMonitorError(f"section names must be non-empty strings, got {name!r}")
        idx = len(self._names)
        if idx >= layout.MAX_SECTIONS:
            raise RankMonitorError(
                f"too many section names (at most {layout.MAX_SECTIONS}); cannot add {name!r}"
            )
        try:
            layout.write_name(buf, self._slot, idx, name)
        except ValueError as exc:
            raise RankMonitorError(str(exc)) from None
        self._names.append(name)
        self._index[name] = idx
        limit = self.learned.sections.get(name)
        if limit is not None:
            _pack_f64(buf, self._base + layout.OFF_LIMIT + 8 * idx, limit)
        # The count goes last: the scanner only reads names below it.
        _pack_i64(buf, self._base + layout.OFF_NAME_COUNT, idx + 1)
        return idx

    # -- learned timeouts ------------------------------------------------------------
    def observations(self) -> Observations:
        """The longest intervals this rank has seen so far."""
        oos = self._max_oos if self._max_oos > 0 else None
        if self._buf is not None and not self._n_open and self._names:
            # The stretch since the last section closed counts too (it may be the longest).
            oos = max(oos or 0.0, _monotonic() - self._oos_since)
        return Observations(
            hb_initial=self._first_hb_gap,
            hb=self._max_hb_gap if self._max_hb_gap > 0 else None,
            sections={
                n: self._longest[i] for i, n in enumerate(self._names) if self._longest[i] > 0
            },
            oos=oos,
        )

    def _agreed_observations(self) -> Observations:
        self._sync_seq += 1
        payloads = gather_json(self.observations().to_json(), self.store, self._sync_seq)
        return merge_max([Observations.from_json(p) for p in payloads])

    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """Sets heartbeat timeouts to the longest gaps seen on any rank x safety factor.

        Collective: every rank must call it. Returns False (or raises) if no rank has
        seen two heartbeats yet.
        """
        self._ready()
        obs = self._agreed_observations()
        if obs.hb is None:
            if skip_if_not_ready:
                return False
            raise RankMonitorError("not enough heartbeats observed to compute timeouts")
        hb = obs.hb * self.safety_factor
        initial = max(hb, (obs.hb_initial or 0.0) * self.safety_factor)
        if self.learned.hb is not None:
            # As NVIDIA's client: a new estimate is averaged into the one already learned
            # (or restored), so one quick run does not shrink a timeout to its last gaps.
            initial = _ema(self.learned.hb_initial or self.learned.hb, initial)
            hb = _ema(self.learned.hb, hb)
        self.learned.hb, self.learned.hb_initial = hb, initial
        self._write_learned()
        log.info("learned heartbeat timeouts: initial %.3f s, subsequent %.3f s", initial, hb)
        return True

    def calculate_and_set_section_timeouts(
        self,
        selected_sections: Collection[str] | None = None,
        calc_out_of_section: bool = True,
        skip_if_not_ready: bool = False,
    ) -> bool:
        """Sets section (and out-of-section) timeouts from the longest durations on any rank.

        Collective. `selected_sections=None` means every section any rank has used.
        """
        self._ready()
        obs = self._agreed_observations()
        if selected_sections is None:
            # Every section the config names must have been seen too, as NVIDIA's does.
            wanted = sorted(set(obs.sections) | set(self._configured.sections))
        else:
            wanted = sorted(selected_sections)
        missing = [n for n in wanted if n not in obs.sections]
        if missing or (calc_out_of_section and obs.oos is None):
            if skip_if_not_ready:
                return False
            what = ", ".join(repr(n) for n in missing) or "out-of-section time"
            raise RankMonitorError(f"not enough data to compute timeouts for {what}")
        learned = self.learned
        for name in wanted:
            new = obs.sections[name] * self.safety_factor
            old = learned.sections.get(name)
            learned.sections[name] = new if old is None else _ema(old, new)
        if calc_out_of_section and obs.oos is not None:
            new = obs.oos * self.safety_factor
            learned.oos = new if learned.oos is None else _ema(learned.oos, new)
        self._write_learned()
        log.info(
            "learned section timeouts: %s, out-of-section %s",
            self.learned.sections,
            self.learned.oos,
        )
        return True

    def _write_learned(self) -> None:
        """Puts learned timeouts into our slot: the monitor uses them from its next scan."""
        buf = self._buf
        if buf is None:
            return
        learned = self.learned
        if learned.hb is not None:
            _pack_f64(buf, self._base + layout.OFF_HB, learned.hb)
            _pack_f64(buf, self._base + layout.OFF_HB_INITIAL, learned.hb_initial or learned.hb)
        if learned.oos is not None:
            _pack_f64(buf, self._base + layout.OFF_OOS, learned.oos)
        for name, secs in learned.sections.items():
            idx = self._index.get(name)
            if idx is None:
                idx = self._register(name)  # also writes its limit
            else:
                _pack_f64(buf, self._base + layout.OFF_LIMIT + 8 * idx, secs)

    @property
    def hb_timeouts(self) -> HeartbeatTimeouts | None:
        """Heartbeat timeouts in force: learned ones where there are, else the node's config
        (None before `init_workload_monitoring`, as NVIDIA's client)."""
        if self._buf is None:
            return None
        learned, conf = self.learned, self._configured
        if learned.hb is not None:
            return HeartbeatTimeouts(learned.hb_initial or learned.hb, learned.hb, True)
        return HeartbeatTimeouts(conf.hb_initial, conf.hb, False)

    @property
    def section_timeouts(self) -> SectionTimeouts | None:
        """Section timeouts in force: the config's, with learned ones taking precedence
        (None before `init_workload_monitoring`, as NVIDIA's client)."""
        if self._buf is None:
            return None
        learned, conf = self.learned, self._configured
        table: dict[str, float | None] = {**conf.sections, **learned.sections}
        return SectionTimeouts(
            section=table,
            out_of_section=learned.oos if learned.oos is not None else conf.oos,
            calculated_sections=frozenset(learned.sections),
            is_out_of_section_calculated=learned.oos is not None,
        )

    def state_dict(self) -> dict[str, Any]:
        """Learned timeouts as plain data (identical on every rank); put it in a checkpoint."""
        return {STATE_KEY: self.learned.to_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores learned timeouts; takes effect at once, or at init if not yet initialised.

        Takes stalwart's state ({"stalwart_monitor": ...}) or NVIDIA's RankMonitorClient's
        ({"current_timeouts": {"heartbeat": ..., "section": ...}}); an empty mapping (no
        checkpoint yet) changes nothing; anything else is a RankMonitorError.
        """
        if not isinstance(state, Mapping):
            raise RankMonitorError(
                f"load_state_dict expects a mapping with key {STATE_KEY!r} or "
                f"{NVIDIA_STATE_KEY!r}, got {type(state).__name__}"
            )
        try:
            if STATE_KEY in state:
                learned = LearnedTimeouts.from_state(state[STATE_KEY])
            elif NVIDIA_STATE_KEY in state:
                learned = from_nvidia_state(state[NVIDIA_STATE_KEY])
            elif not state:
                return
            else:
                keys = ", ".join(sorted(map(repr, state)))
                raise RankMonitorError(
                    f"monitor state has key(s) {keys}; expected {STATE_KEY!r} (stalwart) "
                    f"or {NVIDIA_STATE_KEY!r} (NVIDIA's RankMonitorClient)"
                )
        except (ValueError, TypeError, AttributeError) as exc:
            raise RankMonitorError(f"bad monitor state: {exc}") from None
        self.learned = learned
        self._write_learned()

    # -- workload control ------------------------------------------------------------
    def send_workload_control_request(self, action: ControlAction | str) -> None:
        """Asks the launcher to continue, exclude this node, or shut the workload down."""
        action = ControlAction(action)
        path = os.environ.get(envvars.TIMER_FILE)
        if not path:
            raise RankMonitorError(
                f"workload control requests need a stalwart launcher ({envvars.TIMER_FILE} unset)"
            )
        if self._pipe is None or self._pipe.path != path:
            self._pipe = PipeWriter(path)
        rank = os.environ.get(envvars.GLOBAL_RANK) or os.environ.get(base_env.RANK)
        msg = ControlMessage(os.getpid(), int(rank) if rank else None, action)
        try:
            self._pipe.write(encode(msg))
        except PipeError as exc:
            raise RankMonitorError(str(exc)) from None

    # -- uncaught exceptions ---------------------------------------------------------
    def _hook_exceptions(self) -> None:
        if self._prev_hook is None:
            self._prev_hook = sys.excepthook
            sys.excepthook = self._excepthook

    def _excepthook(
        self,
        exc_type: type[BaseException],
        exc: BaseException,
        tb: types.TracebackType | None,
    ) -> None:
        self.last_exception = f"{exc_type.__name__}: {exc}"
        # Open sections would otherwise time out while the process is exiting.
        with contextlib.suppress(Exception):
            if self._buf is not None:
                self.end_all_sections()
        log.error("uncaught exception in rank: %s", self.last_exception)
        prev = self._prev_hook or sys.__excepthook__
        prev(exc_type, exc, tb)
