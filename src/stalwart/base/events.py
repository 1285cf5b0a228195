"""The kinds of record in a run's ``events.jsonl``: spelled here only, imported by every
side that writes one (the launcher, the node monitor, workers through ``runlog``) and by
every side that reads them (``stalwart report``, goodput, the timeline, metrics).

A member is a ``str``, so it is written to JSON as its value and compares equal to the
``"event"`` field of a record read back.
"""

from __future__ import annotations

import enum


class Event(enum.StrEnum):
    # -- the launcher's life ---------------------------------------------------------
    LAUNCHER_START = "launcher_start"
    LAUNCHER_EXIT = "launcher_exit"
    #: A signal asked the launcher to stop the job.
    SHUTDOWN = "shutdown"
    RENDEZVOUS_DONE = "rendezvous_done"
    RENDEZVOUS_ERROR = "rendezvous_error"
    CKPT_RAM_RESERVED = "ckpt_ram_reserved"
    #: A local rank's snapshot segment was damaged (cut short, replaced) and made anew;
    #: its snapshots are lost, so that rank resumes from disk or another copy.
    CKPT_RAM_REPAIRED = "ckpt_ram_repaired"
    #: A replica server refused a connection or a request (not of the job, over a
    #: limit, malformed); rate-limited, one line per kind.
    REPLICA_CONN_REFUSED = "replica_conn_refused"
    # -- snapshot replicas on peer nodes (launch/replicas/node.py) ---------------------------
    #: A peer to replicate to stopped answering; replication moved on to the next node.
    REPLICA_PEER_LOST = "replica_peer_lost"
    #: This node could not reserve memory for a peer's replica (the peer's push is refused).
    REPLICA_NO_ROOM = "replica_no_room"
    #: A peer refused a replica (no room, or a checksum that did not match).
    REPLICA_REFUSED = "replica_refused"
    #: A rank this node takes over was restored into its memory from a peer's replica.
    REPLICA_FETCHED = "replica_fetched"
    #: No peer could give a snapshot of a rank this node takes over (disk restore follows).
    REPLICA_FETCH_FAILED = "replica_fetch_failed"
    # -- one attempt (round) -----------------------------------------------------------
    WORKER_SPAWN = "worker_spawn"
    WORKER_EXIT = "worker_exit"
    #: A worker's training progress (step, rate), sampled by the launcher.
    PROGRESS = "progress"
    #: Another node's workers failed, so this node's round ends too.
    PEER_FAILURE = "peer_failure"
    WORKERS_STOPPING = "workers_stopping"
    #: A descendant of a worker still running after the round ended.
    STRAY_PROCESS = "stray_process"
    NODES_LEFT = "nodes_left"
    #: Nodes wait to join a job below MAX: this node ends the round so the job grows.
    NODES_WAITING = "nodes_waiting"
    RANKS_LEFT = "ranks_left"
    NODE_LOST = "node_lost"
    NODE_EXCLUDED = "node_excluded"
    #: A node ran its health checks before a round (health/admission.py).
    HEALTH_CHECKED = "health_checked"
    #: A node was implicated in K of the job's last M failed rounds and is kept out of
    #: later rounds (``health/quarantine.py``); every node that sees it writes one.
    NODE_QUARANTINED = "node_quarantined"
    #: A quarantined node's time is up: it may join rounds again.
    NODE_RELEASED = "node_released"
    #: The round failed and another starts.
    RESTART = "restart"
    # -- how the job ended -----------------------------------------------------------
    JOB_SUCCEEDED = "job_succeeded"
    JOB_FAILED = "job_failed"
    JOB_STOPPED = "job_stopped"
    JOB_ENDED_WITHOUT_THIS_NODE = "job_ended_without_this_node"
    # -- the warm template ---------------------------------------------------------------
    TEMPLATE_START = "template_start"
    TEMPLATE_READY = "template_ready"
    TEMPLATE_UNUSABLE = "template_unusable"
    TEMPLATE_DIED = "template_died"
    TEMPLATE_LEARN = "template_learn"
    TEMPLATE_LEARN_FAILED = "template_learn_failed"
    WARM_SPAWN_REFUSED = "warm_spawn_refused"
    # -- the node monitor ----------------------------------------------------------------
    MONITOR_STARTED = "monitor_started"
    MONITOR_ATTEMPT_STARTED = "monitor_attempt_started"
    MONITOR_BAD_SLOT = "monitor_bad_slot"
    MONITOR_BAD_REQUEST = "monitor_bad_request"
    HANG_DETECTED = "hang_detected"
    TIMER_EXPIRED = "timer_expired"
    TIMEOUTS_LEARNED = "timeouts_learned"
    STRAGGLER = "straggler"
    CONTROL_REQUEST = "control_request"
    CONTROL_REQUEST_REFUSED = "control_request_refused"
    # -- written by workers (``stalwart.runlog``) ------------------------------------------
    #: A fault from ``--inject`` fired in this worker (written just before it acts).
    FAULT_INJECTED = "fault_injected"
    #: A checkpoint became complete and loadable (``step`` is the training step it holds).
    CHECKPOINT_COMMIT = "checkpoint_commit"
    #: A rank loaded a sharded (DCP) step to resume from (``source``: ``ram`` or ``disk``).
    CHECKPOINT_RESTORED = "checkpoint_restored"
