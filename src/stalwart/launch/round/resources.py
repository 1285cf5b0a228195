"""What a job needs on this node besides its workers: made at the start, closed at the end.

The guardian, the job cgroup, the warm template and the health gate (`prestart`, before
anything imports torch), then the hang monitor, the progress board, RAM snapshots and their replicas,
and the rendezvous (`set_up`).  `RoundResources` owns them all and closes them in one
ordered `close()`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

from stalwart.base import envvars, procs
from stalwart.base.events import Event
from stalwart.base.sealed import write_worker_key
from stalwart.config import ConfigError, LaunchConfig
from stalwart.config.secret import (
    missing_secret,
    node_secret,
    unauthenticated_store,
    worker_environ,
)
from stalwart.health.admission import HealthGate, gate_for
from stalwart.health.guard import QuarantineGuard, guard_for
from stalwart.launch.replicas.auth import job_key
from stalwart.launch.replicas.node import NodeReplicas, advertised_address, effective_replicas
from stalwart.launch.replicas.snapshots import SnapshotMemory
from stalwart.launch.round.hangs import HangWatch
from stalwart.launch.round.membership import rendezvous_for
from stalwart.launch.workers.cgroup import JobCgroup
from stalwart.launch.workers.environment import program_argv
from stalwart.launch.workers.guardian import Guardian
from stalwart.launch.workers.warm import WarmPool
from stalwart.progress import ProgressBoard
from stalwart.rendezvous import Rendezvous

logger = logging.getLogger(__name__)


class RoundResources:
    """The job's helpers on this node; each is None until made (a run may end first)."""

    def __init__(
        self,
        cfg: LaunchConfig,
        emit: Callable[..., object],
        run_dir: Path | None,
        rendezvous: Rendezvous | None = None,
    ) -> None:
        self.cfg = cfg
        self._emit = emit
        self._run_dir = run_dir
        self.token = uuid.uuid4().hex
        self.rdzv = rendezvous
        # Read once and kept in memory: the workers' environment goes without it.
        self._secret = node_secret(cfg.job_secret_file, os.environ, multi_node=cfg.max_nodes > 1)
        self.worker_key_env: dict[str, str] = {}  # where workers find their records' key
        self.quarantine: QuarantineGuard | None = None  # None: off (guard_for says when)
        self.health: HealthGate | None = None  # checks before each round (--node-health)
        self._gated = False  # the gate made (in prestart)
        self.guardian: Guardian | None = None
        self.cgroup: JobCgroup | None = None
        self.warm: WarmPool | None = None
        self.hangs: HangWatch | None = None
        self.progress: ProgressBoard | None = None
        self.snapshots: SnapshotMemory | None = None
        self.replicas: NodeReplicas | None = None

    def set_up(self) -> Rendezvous:
        """Everything a round needs besides the rendezvous' answer; returns the
        rendezvous (made from the configuration unless one was given)."""
        cfg = self.cfg
        self.prestart()
        # The guardian learns the monitor folder the moment it exists, before the
        # monitor starts, so a SIGKILL at any later point leaves no folder behind.
        self.hangs = HangWatch(
            cfg.run_id,
            cfg.monitor,
            cfg.nproc_per_node,
            self._emit,
            on_folder=self.guardian.remove_on_death if self.guardian else None,
            # Learned timeouts and hang dossiers live in the run folder.
            state_dir=self._run_dir,
        )
        if self._secret is not None:
            # In the monitor's private folder (0700), gone with it.
            self.worker_key_env = write_worker_key(self.hangs.ipc, self._secret, cfg.run_id)
        self.progress = ProgressBoard(self.hangs.ipc, cfg.nproc_per_node)
        if cfg.ckpt_ram:
            self.snapshots = SnapshotMemory(cfg.nproc_per_node, cfg.ckpt_ram)
            if self.guardian is not None:
                self.guardian.remove_on_death(self.snapshots.folder)
            self._emit(
                Event.CKPT_RAM_RESERVED,
                folder=str(self.snapshots.folder),
                bytes_per_rank=cfg.ckpt_ram,
                segment_bytes=self.snapshots.segment_bytes,
            )
        if self.rdzv is None:
            self.rdzv = rendezvous_for(cfg, self._secret, self.health)
            # Once the store is reached (an unreachable one stays a one-line error); etcd
            # has authentication of its own.
            if self._secret is None and cfg.rdzv_backend != "etcd":
                logger.warning("%s", unauthenticated_store())
        self._start_replicas(self.rdzv)
        where = advertised_address(self.rdzv)
        kv = where[0] if where is not None else None
        self.quarantine = guard_for(cfg, kv, self._emit, os.environ)
        if self.health is not None and self.quarantine is not None:
            # One gate: a round this node closes keeps quarantined joiners out too.
            self.health.consult(self.quarantine)
        return self.rdzv

    def quiesce(self) -> None:
        """First of the teardown: no warm template is forked while the rest closes."""
        if self.warm is not None:
            self.warm.stop_learning()

    def close(self) -> None:
        """Closes what was made, in this order (the workers are stopped before).  Each
        step runs whatever an earlier one raised, and the first error is re-raised once
        all have run: a store that is gone must not leave the monitor or the guardian
        behind."""
        with contextlib.ExitStack() as steps:
            # Late: until the guardian is told to exit it still removes what is left (the
            # monitor folder, stray processes) should this process be SIGKILLed now.
            steps.callback(self._close_guardian)
            # Before the snapshots: the replicas' server and pushes read their folder.
            for close in reversed(
                [
                    self.rdzv.leave if self.rdzv is not None else None,
                    self.health.close if self.health is not None else None,
                    self.progress.close if self.progress is not None else None,
                    self.hangs.stop if self.hangs is not None else None,
                    self.warm.close if self.warm is not None else None,
                    self.replicas.close if self.replicas is not None else None,
                    self.snapshots.close if self.snapshots is not None else None,
                ]
            ):
                if close is not None:
                    steps.callback(close)

    def _close_guardian(self) -> None:
        # A process stuck in uninterruptible sleep keeps the cgroup busy: the guardian
        # then stays behind and removes it once the process is gone.  (Workers were
        # given their KILL_WAIT already: no second long wait here.)
        linger = self.cgroup is not None and not self.cgroup.remove(timeout=1.0)
        if self.guardian is not None:
            self.guardian.close(linger=linger)

    def keep_pids(self) -> set[int]:
        """The launcher's own children that are not workers (never reaped as orphans)."""
        keep: set[int] = set()
        if self.guardian is not None:
            keep.add(self.guardian.proc.pid)
        if self.warm is not None:
            keep |= self.warm.owned_pids()
        return keep

    def _start_replicas(self, rdzv: Rendezvous) -> None:
        k = effective_replicas(self.cfg.ckpt_replicas, self.cfg.max_nodes)
        where = advertised_address(rdzv) if self.snapshots is not None and k else None
        if self.snapshots is not None and where is not None:
            kv, addr = where
            self.replicas = NodeReplicas(
                self.snapshots.folder,
                self.snapshots.slot_bytes,
                self.cfg.nproc_per_node,
                k,
                kv,
                addr,
                self._emit,
                max_nodes=self.cfg.max_nodes,
                key=job_key(self._replica_secret(), self.cfg.run_id),
            )

    def _replica_secret(self) -> bytes:
        # validate() made sure a multi-node job with replicas was given one.
        if self._secret is None:
            raise ConfigError(missing_secret())
        return self._secret

    def prestart(self) -> None:
        """Starts the guardian, the warm template and the health gate; cheap, and
        torch-free, so a caller can do it before anything imports torch in the launcher
        (``run`` does it too)."""
        # Before the template forks anything: workers it makes are re-parented to us.
        procs.set_child_subreaper()
        if self.guardian is None:
            self.guardian = Guardian(self.token)
            self.cgroup = JobCgroup.create(self.token, self.guardian.kill_cgroup_on_death)
            if self.cgroup is not None:
                logger.debug("job cgroup %s", self.cgroup.path)
        if self.warm is None:
            self.warm = self._start_warm()
            template = self.warm.template_pid() if self.warm is not None else None
            if self.cgroup is not None and template is not None:
                # Workers it forks are born in the job's cgroup.
                self.cgroup.join(template)
        if not self._gated:
            self._gated = True
            # Now, before this process imports torch: the gate asks the template for the
            # first round's link check at once, which it forks as soon as its own
            # torch.distributed is in (asked later, it would come after dynamo and the rest).
            self.health = gate_for(self.cfg, self._emit, self._run_dir, self.warm)

    def _start_warm(self) -> WarmPool | None:
        """The warm template starts now, so its imports overlap the rendezvous."""
        cfg = self.cfg
        if not cfg.warm or cfg.no_python:
            return None
        env = worker_environ(os.environ)
        env[envvars.RUN_TOKEN] = self.token
        # OpenMP reads it when torch loads in the template; with more than one thread the
        # template could not fork.  Workers that should have more get them back after the
        # fork (zygote._become_worker).
        env.setdefault(envvars.OMP_NUM_THREADS, "1")

        log = str(self._run_dir / "template.log") if self._run_dir is not None else os.devnull
        # Room in the template's command line for a worker's title (bootstrap.set_title).
        room = len(" ".join([sys.executable, "-u", *program_argv(cfg)[1][3:]])) + 1
        pool = WarmPool(list(cfg.preload), env, self._emit, log_path=log, title_room=room)
        pool.start()
        return pool
