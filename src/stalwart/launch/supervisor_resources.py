"""What a job needs on this node besides its workers: made at the start, closed at the end.

The guardian, the job cgroup and the warm template (`prestart`, before anything imports
torch), then the hang monitor, the progress board, RAM snapshots and their replicas,
and the rendezvous (`_set_up`); the steps that close them run in `Supervisor.run`'s
teardown (`Supervisor._teardown_steps` says in which order).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from stalwart.base import envvars, procs
from stalwart.base.events import Event
from stalwart.base.sealed import write_worker_key
from stalwart.config import ConfigError
from stalwart.config.secret import missing_secret, unauthenticated_store, worker_environ
from stalwart.health.guard import guard_for
from stalwart.launch.cgroup import JobCgroup
from stalwart.launch.environment import program_argv
from stalwart.launch.guardian import Guardian
from stalwart.launch.hangs import HangWatch
from stalwart.launch.membership import rendezvous_for
from stalwart.launch.replica_auth import job_key
from stalwart.launch.replicas import NodeReplicas, advertised_address, effective_replicas
from stalwart.launch.snapshots import SnapshotMemory
from stalwart.launch.supervisor_state import SupervisorState
from stalwart.launch.warm import WarmPool
from stalwart.progress import ProgressBoard
from stalwart.rendezvous import Rendezvous

logger = logging.getLogger(__name__)


class SupervisorResources(SupervisorState):
    """Making and closing the job's resources on this node."""

    def _set_up(self) -> Rendezvous:
        """Everything a round needs besides the rendezvous' answer; returns the
        rendezvous (made from the configuration unless one was given)."""
        cfg = self.cfg
        self.prestart()
        # The guardian learns the monitor folder the moment it exists, before the
        # monitor starts, so a SIGKILL at any later point leaves no folder behind.
        self._hangs = HangWatch(
            cfg.run_id,
            cfg.monitor,
            cfg.nproc_per_node,
            self.events.emit,
            on_folder=self._guardian.remove_on_death if self._guardian else None,
            # Learned timeouts and hang dossiers live in the run folder.
            state_dir=self.run_dir,
        )
        if self._secret is not None:
            # In the monitor's private folder (0700), gone with it.
            self._worker_key_env = write_worker_key(self._hangs.ipc, self._secret, cfg.run_id)
        self._progress = ProgressBoard(self._hangs.ipc, cfg.nproc_per_node)
        if cfg.ckpt_ram:
            self._snapshots = SnapshotMemory(cfg.nproc_per_node, cfg.ckpt_ram)
            if self._guardian is not None:
                self._guardian.remove_on_death(self._snapshots.folder)
            self.events.emit(
                Event.CKPT_RAM_RESERVED,
                folder=str(self._snapshots.folder),
                bytes_per_rank=cfg.ckpt_ram,
                segment_bytes=self._snapshots.segment_bytes,
            )
        if self._rdzv is None:
            self._rdzv = rendezvous_for(cfg, self._secret)
            # Once the store is reached (an unreachable one stays a one-line error); etcd
            # has authentication of its own.
            if self._secret is None and cfg.rdzv_backend != "etcd":
                logger.warning("%s", unauthenticated_store())
        self._start_replicas(self._rdzv)
        where = advertised_address(self._rdzv)
        kv = where[0] if where is not None else None
        self._quarantine = guard_for(cfg, kv, self.events.emit, os.environ)
        return self._rdzv

    def _start_replicas(self, rdzv: Rendezvous) -> None:
        k = effective_replicas(self.cfg.ckpt_replicas, self.cfg.max_nodes)
        where = advertised_address(rdzv) if self._snapshots is not None and k else None
        if self._snapshots is not None and where is not None:
            kv, addr = where
            self._replicas = NodeReplicas(
                self._snapshots.folder,
                self._snapshots.slot_bytes,
                self.cfg.nproc_per_node,
                k,
                kv,
                addr,
                self.events.emit,
                max_nodes=self.cfg.max_nodes,
                key=job_key(self._replica_secret(), self.cfg.run_id),
            )

    def _replica_secret(self) -> bytes:
        # validate() made sure a multi-node job with replicas was given one.
        if self._secret is None:
            raise ConfigError(missing_secret())
        return self._secret

    def _stop_workers(self) -> None:
        self._stopping = True
        if self._ctx is not None:
            self._ctx.close(signal.SIGTERM, self.cfg.shutdown_timeout)

    def _remove_cgroup(self) -> None:
        # A process stuck in uninterruptible sleep keeps the cgroup busy: the guardian
        # then stays behind and removes it once the process is gone.
        # (Workers were given their KILL_WAIT already: no second long wait here.)
        self._linger = self._cgroup is not None and not self._cgroup.remove(timeout=1.0)

    def prestart(self) -> None:
        """Starts the guardian and the warm template; cheap, and torch-free, so a caller
        can do it before anything imports torch in the launcher (``run`` does it too)."""
        # Before the template forks anything: workers it makes are re-parented to us.
        procs.set_child_subreaper()
        if self._guardian is None:
            self._guardian = Guardian(self._token)
            self._cgroup = JobCgroup.create(self._token, self._guardian.kill_cgroup_on_death)
            if self._cgroup is not None:
                logger.debug("job cgroup %s", self._cgroup.path)
        if self._warm is None:
            self._warm = self._start_warm()
            template = self._warm.template_pid() if self._warm is not None else None
            if self._cgroup is not None and template is not None:
                # Workers it forks are born in the job's cgroup.
                self._cgroup.join(template)

    def _start_warm(self) -> WarmPool | None:
        """The warm template starts now, so its imports overlap the rendezvous."""
        cfg = self.cfg
        if not cfg.warm or cfg.no_python:
            return None
        env = worker_environ(os.environ)
        env[envvars.RUN_TOKEN] = self._token
        # OpenMP reads it when torch loads in the template; with more than one thread the
        # template could not fork.  Workers that should have more get them back after the
        # fork (zygote._become_worker).
        env.setdefault(envvars.OMP_NUM_THREADS, "1")

        log = str(self.run_dir / "template.log") if self.run_dir is not None else os.devnull
        # Room in the template's command line for a worker's title (bootstrap.set_title).
        room = len(" ".join([sys.executable, "-u", *program_argv(cfg)[1][3:]])) + 1
        pool = WarmPool(list(cfg.preload), env, self.events.emit, log_path=log, title_room=room)
        pool.start()
        return pool
