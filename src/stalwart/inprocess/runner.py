"""One invocation of a wrapped function: the restart loop.

Per iteration ``n``: assign ranks from the authoritative terminated set, export
``RANK``/``WORLD_SIZE``/``MASTER_PORT``, start the monitor thread, run
``initialize`` and the function (or wait as a spare), then the completion
barrier.  On a fault anywhere: record it, abort communication, stop the monitor
thread, destroy process groups, run ``finalize`` and the health check, meet the
survivors at the termination barrier, and go to ``n + 1``.

The main thread may receive ``RankShouldRestart`` at any bytecode while the
monitor thread runs, so everything up to the point where that thread is joined
sits in one retry loop (``_run_body``).

A ``RankShouldRestart`` the function raises itself (not injected) is a fault like
an exception (every rank restarts), as in NVIDIA's wrapper.  Any other
``BaseException`` the function raises (``SystemExit``, ``KeyboardInterrupt``,
``GeneratorExit``, ``RestartAbort``) leaves the wrapper unchanged on that rank: it is recorded as this rank's termination,
so the others restart without it, and on the store host the store stays up
until every other rank has left.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from stalwart.base import envvars
from stalwart.base.liveness import CounterWatch
from stalwart.base.sealed import worker_seal

from .assignment import assignment_input, call_assignment, discarded_by, function_view
from .asyncexc import clear_pending, install_wake_handler, reraise_if_unraisable
from .call import Call, inject_call
from .errors import (
    ConfigError,
    InProcessError,
    RankShouldRestart,
    RankTerminated,
    RestartError,
    RestartLimitReached,
    RestartRequested,
)
from .groups import GroupKeeper
from .iteration_stores import IterationStores
from .monitor_process import MonitorProcess
from .monitor_thread import AtomicGate, MonitorThread
from .options import Options
from .progress import Periodic, ProgressClock
from .runner_ending import Ending
from .runner_faults import FaultHandling, expect_state, hook_failed
from .sockets import open_socket_fds
from .state import Mode, State
from .store import ITERATION_ENV, CoordStore, store_port

log = logging.getLogger(__name__)

HOST_RANK = 0
# Counts wrapped calls in this process; every rank makes the same calls in order.
_CALLS = itertools.count()
_EXPORTED_ENV = (
    envvars.RANK,
    envvars.WORLD_SIZE,
    envvars.MASTER_PORT,
    envvars.USE_AGENT_STORE,
    ITERATION_ENV,
)


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise InProcessError(f"{name} is not set: run under torchrun or `stalwart run`")
    return int(value)


@dataclasses.dataclass
class _Outcome:
    finished: bool = False
    value: Any = None
    error: Exception | None = None
    interrupted: bool = False
    # A BaseException from the function: this rank leaves with it, unchanged.
    exit: BaseException | None = None


class Runner:
    """Owns the store clients, background threads, monitor process and gate for one call,
    and runs the loop; what it does about a fault is `FaultHandling`'s, how the call ends
    on this rank `Ending`'s."""

    def __init__(self, options: Options) -> None:
        if dist.is_available() and dist.is_initialized():
            # A ValueError, as NVIDIA's wrapper raises for the same mistake.
            raise ConfigError(
                "torch.distributed is already initialized (the wrapper needs "
                "not torch.distributed.is_initialized() when called): "
                "call init_process_group inside the wrapped function"
            )
        self.opts = options
        rank = _env_int(envvars.RANK)
        world = _env_int(envvars.WORLD_SIZE)
        self.state = State(rank=rank, world_size=world, initial_rank=rank, initial_world_size=world)
        # What the last rank assignment gave (before any rank filter), and the
        # terminated initial ranks it was told of: NVIDIA's assignments renumber from
        # there (Options.rank_numbering).
        self._placed = (rank, world)
        self._accounted: frozenset[int] = frozenset()
        self.main_tid = threading.get_ident()
        # The wrapper rewrites these per iteration; put the launcher's back at the end.
        self._saved_env = {k: os.environ.get(k) for k in _EXPORTED_ENV}
        self.is_host = rank == HOST_RANK
        # A RestartError from initialize: this rank leaves with it instead of restarting.
        self._leave_with: Exception | None = None
        self._closers: list[Callable[[], None]] = []
        try:
            self._start()
        except BaseException:
            self._close()
            raise

    def _start(self) -> None:
        opts, rank = self.opts, self.state.initial_rank
        # A rank whose counter stands still this long is gone (local time only).
        self.liveness = CounterWatch[int](opts.heartbeat_timeout)
        call = next(_CALLS)
        store_kwargs = opts.store_kwargs or {}
        # The launcher's key for this job's records (none under plain torchrun).
        seal = worker_seal(os.environ)
        main_store = opts.store_factory(is_host=self.is_host, **store_kwargs)
        self.coord = CoordStore(main_store, rank, self.liveness, call, seal)
        self.monitor_coord = CoordStore(
            opts.store_factory(is_host=False, **store_kwargs), rank, self.liveness, call, seal
        )
        heartbeat_coord = CoordStore(
            opts.store_factory(is_host=False, **store_kwargs), rank, self.liveness, call, seal
        )
        port = store_port(main_store)
        self.protected_ports = frozenset([port]) if port is not None else frozenset()
        self.clock = ProgressClock()
        self._closers.append(self.clock.close)
        self.monitor_process = MonitorProcess(
            self.clock,
            rank,
            opts.monitor_process_interval,
            opts.hard_timeout,
            opts.termination_grace_time,
            opts.monitor_process_logfile,
        )
        self._closers.append(self.monitor_process.stop)
        interval = opts.progress_watchdog_interval
        self.ticker = Periodic("tick", self.clock.tick, interval)
        self.heartbeat = Periodic("heartbeat", heartbeat_coord.heartbeat, interval)
        for thread in (self.ticker, self.heartbeat):
            thread.beat()
            thread.start()
            self._closers.append(thread.stop)
        self.gate = AtomicGate()
        self._closers.append(install_wake_handler())
        # Everything alive now (torch, the user's model) outlives every restart;
        # freezing it keeps the collection between iterations from walking it
        # (measured: 0.25 s -> <1 ms with DDP loaded).
        gc.freeze()
        self._closers.append(gc.unfreeze)
        self.groups = GroupKeeper()
        self.iteration_stores = IterationStores()
        self._closers.append(self.iteration_stores.close)
        self.call_obj = Call(self.state, self.clock, self.gate, None)
        self.faults = FaultHandling(opts, self.coord, self.groups, self.clock)
        self.ending = Ending(
            self.coord,
            self.is_host,
            self.iteration_stores,
            self.groups,
            (self.monitor_process, self.ticker, self.heartbeat),
            opts.last_call_wait,
        )

    def _close(self) -> None:
        while self._closers:
            closer = self._closers.pop()
            try:
                closer()
            except Exception:
                log.exception("cleanup step failed")

    # -- the loop --------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        opts, coord = self.opts, self.coord
        state = self.state
        clean_exit = False
        try:
            if self.is_host:
                coord.publish_port(0, self.iteration_stores.open(0))
            terminated = coord.barrier(
                "init", list(range(state.initial_world_size)), opts.barrier_timeout
            )
            iteration = 0
            while True:
                state = self._assign(state, iteration, terminated)
                self.state = state
                outcome = self._run_iteration(fn, args, kwargs, state)
                state = self.state  # as initialize returned it
                if outcome.exit is not None:
                    raise outcome.exit
                if outcome.finished:
                    self.groups.release()
                    self.faults.finalize(state, None)
                    clean_exit = True
                    return outcome.value if state.mode is Mode.ACTIVE else None
                error = outcome.error
                del outcome  # its traceback pins the failed iteration's tensors and groups
                t0 = time.monotonic()
                self.faults.after_fault(state, error)
                del error
                t1 = time.monotonic()
                if self.is_host:
                    coord.publish_port(iteration + 1, self.iteration_stores.open(iteration + 1))
                terminated = terminated | coord.barrier(
                    f"it{iteration}/end", state.alive_ranks, opts.barrier_timeout
                )
                if self.is_host:
                    self.ending.log_interruptions(state)
                log.debug(
                    "restart phases: cleanup %.3fs, termination barrier %.3fs",
                    t1 - t0,
                    time.monotonic() - t1,
                )
                iteration += 1
        except BaseException as exc:
            self.ending.leave_abnormally(state, exc)
            raise
        finally:
            self._finish(clean_exit)

    def _finish(self, clean: bool) -> None:
        self.ending.finish(self.state, clean)
        self._close()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        gc.collect()

    def _assign(self, state: State, iteration: int, terminated: frozenset[int]) -> State:
        opts = self.opts
        if state.initial_rank in terminated:
            raise RankTerminated(f"initial rank {state.initial_rank} was declared terminated")
        if opts.max_iterations is not None and iteration >= opts.max_iterations:
            raise RestartLimitReached(f"max_iterations={opts.max_iterations} reached")
        state = dataclasses.replace(state, iteration=iteration)
        state = self._place(state, iteration, terminated)
        if state.mode is Mode.TERMINATED:
            raise RankTerminated(
                f"initial rank {state.initial_rank} has no rank in the new assignment"
            )
        state = function_view(state)
        if opts.rank_filter is not None:
            state = opts.rank_filter(state)
        os.environ[envvars.RANK] = str(state.rank)
        os.environ[envvars.WORLD_SIZE] = str(state.world_size)
        os.environ[ITERATION_ENV] = str(iteration)
        if self.is_host:
            self.iteration_stores.close_before(iteration)
        port = self._iteration_port(iteration)
        if port is not None:
            # env:// connects as a client to this iteration's fresh store.
            os.environ[envvars.MASTER_PORT] = str(port)
            os.environ[envvars.USE_AGENT_STORE] = "True"
        state = dataclasses.replace(
            state,
            protected_fds=open_socket_fds(),
            protected_ports=self.protected_ports,
        )
        log.log(
            logging.INFO if iteration > 0 else logging.DEBUG,
            "initial rank %d enters iteration %d as rank %d/%d (%s)",
            state.initial_rank,
            iteration,
            state.rank,
            state.world_size,
            state.mode.value,
        )
        return state

    def _place(self, state: State, iteration: int, terminated: frozenset[int]) -> State:
        """Run the rank assignment in NVIDIA's shape: ``(state, terminated) -> (state, rest)``."""
        last_rank, last_world = self._placed
        fresh = terminated - self._accounted
        if self.opts.rank_numbering == "current" and iteration > 0:
            numbers = self.coord.placed_ranks(iteration - 1, fresh, last_world)
        else:  # nobody was renumbered yet: the initial numbers are the current ones
            numbers = {r: r for r in fresh}
        given, gone = assignment_input(
            self.opts.rank_numbering, state, self._placed, terminated, self._accounted, numbers
        )
        log.debug(
            "rank assignment given rank %d/%d (last %d/%d), terminated %s",
            given.rank,
            given.world_size,
            last_rank,
            last_world,
            sorted(gone),
        )
        placed, unplaced = call_assignment(self.opts.rank_assignment, given, gone, self.coord.store)
        if unplaced:
            raise RestartError(
                f"rank_assignment left terminated ranks {sorted(unplaced)} unaccounted for"
            )
        self._placed = (placed.rank, placed.world_size)
        # Ranks the assignment itself took out (a ``Tree`` branch below its
        # ``min_ranks``): every survivor computed the same, and the ranks concerned
        # raised ``RankDiscarded``, so nobody waits for them or reports them again.
        left = terminated | discarded_by(placed, terminated)
        self._accounted = left
        # Peers translate this rank into the next iteration's numbering if it goes.
        self.coord.publish_placed_rank(iteration, placed.rank)
        # The wrapper's own record of who left; an assignment can only add to it.
        return dataclasses.replace(placed, terminated=left)

    def _iteration_port(self, iteration: int) -> int | None:
        """The iteration's env:// store port; after a store host left, wait for it to serve it."""
        port = self.coord.port(iteration)
        if port is not None or iteration == 0 or self.is_host:
            return port
        if not self.coord.is_terminated(HOST_RANK):
            return None
        deadline = time.monotonic() + self.opts.barrier_timeout
        while time.monotonic() < deadline:
            port = self.coord.port(iteration)
            if port is not None:
                return port
            if self.liveness.stale(HOST_RANK, self.coord.heartbeat_value(HOST_RANK)):
                return None
            time.sleep(0.005)
        return None

    def _run_iteration(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], state: State
    ) -> _Outcome:
        opts = self.opts
        self.clock.disarm()
        self.call_obj._advance(state, self.coord.user_store(state.iteration))
        call_args, call_kwargs = inject_call(fn, args, kwargs, self.call_obj)
        monitor = MonitorThread(
            state=state,
            store=self.monitor_coord,
            participants=state.alive_ranks,
            clock=self.clock,
            gate=self.gate,
            abort=opts.abort,
            interval=opts.monitor_thread_interval,
            soft_timeout=opts.soft_timeout,
            main_thread_id=self.main_tid,
            on_poll=self.groups.observe,
        )
        monitor.start()
        outcome = self._run_body(fn, call_args, call_kwargs, state, monitor)
        if outcome.finished and monitor.fired:
            log.warning("rank %d: restart requested after completion; ignored", state.rank)
        if outcome.error is not None:
            # Once per restart: the monitor thread has aborted already if it fired.
            self.faults.report(self.state, outcome.error, aborted=monitor.fired)
        elif outcome.exit is not None and self.opts.abort is not None:
            # Peers blocked in a collective with this rank are released sooner.
            try:
                self.opts.abort(self.state)
            except Exception:
                log.exception("abort failed")
        return outcome

    def _run_body(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        state: State,
        monitor: MonitorThread,
    ) -> _Outcome:
        outcome: _Outcome | None = None
        while True:
            try:
                if outcome is None:
                    try:
                        self.gate.busy = True
                        value = self._body(fn, args, kwargs, state)
                        self.gate.busy = False
                        outcome = _Outcome(finished=True, value=value)
                    except Exception as exc:
                        self.gate.busy = False
                        if exc is self._leave_with:
                            outcome = _Outcome(exit=exc)
                        else:
                            outcome = _Outcome(error=exc)
                    except RankShouldRestart as exc:
                        self.gate.busy = False
                        if not monitor.fired:  # raised by the function: it asks for a restart
                            requested = RestartRequested("the function raised RankShouldRestart")
                            requested.__cause__ = exc
                            outcome = _Outcome(error=requested)
                        else:
                            outcome = _Outcome(interrupted=True)
                    except BaseException as exc:
                        self.gate.busy = False
                        outcome = _Outcome(exit=exc)
                if outcome.exit is not None:
                    monitor.request_stop()
                    self.faults.record_exit(state, outcome.exit)
                elif outcome.error is not None and not monitor.fired:
                    # This thread handles its own fault: the monitor must not fire on
                    # the flag set next.  Peers learn first, before anything slow.
                    monitor.request_stop()
                    if not monitor.fired:
                        self.faults.record(state, outcome.error)
                monitor.stop()
                clear_pending(self.main_tid)
                self.gate.pending = False
                self.gate.depth = 0
                self.gate.busy = False
                return outcome
            except RankShouldRestart:
                self.gate.busy = False
                if outcome is None:
                    outcome = _Outcome(interrupted=True)

    def _body(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], state: State
    ) -> Any:
        opts, coord = self.opts, self.coord
        if opts.initialize is not None:
            try:
                initialized = opts.initialize(state)
            except RestartError as exc:
                # The hook says stop restarting (``RetryController``): not a fault.
                self._leave_with = exc
                raise
            except Exception as exc:
                hook_failed("initialize", state, exc)
            if initialized is not None:
                state = expect_state("initialize", initialized)
                self.state = state
                self.call_obj._advance(state, self.call_obj.store)
        self.faults.health_check(state, None)
        value = None
        if state.mode is Mode.ACTIVE:
            # A restart landing in a destructor would be swallowed: raise it again.
            with self.clock.on_main_thread(), reraise_if_unraisable(RankShouldRestart):
                value = fn(*args, **kwargs)
            self.clock.disarm()
            coord.record_completed(state.iteration)
        it = state.iteration
        coord.barrier(
            f"it{it}/complete",
            state.alive_ranks,
            opts.completion_timeout,
            clock_starts=lambda: coord.any_completed(it),
        )
        return value


def run_wrapped(
    options: Options, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    runner = Runner(options)
    return runner.run(fn, args, kwargs)


def run_plain(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Disabled wrapper: call once, with a detached ``Call`` if the function asks for one."""
    rank = int(os.environ.get(envvars.RANK, "0"))
    world = int(os.environ.get(envvars.WORLD_SIZE, "1"))
    call = Call(State(rank=rank, world_size=world, initial_rank=rank, initial_world_size=world))
    call_args, call_kwargs = inject_call(fn, args, kwargs, call)
    return fn(*call_args, **call_kwargs)
