"""The contract between a node's supervisor and any rendezvous backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Protocol

import msgspec

from stalwart.base.records import MESSAGE_LIMIT, TRACEBACK_LIMIT, clip


class RendezvousError(RuntimeError):
    """The job cannot form: unreachable endpoint, id mismatch, join timeout."""


class StoreLost(RendezvousError):
    """The rendezvous store stopped answering (its host died, or the network is cut)."""


class JobEnded(Exception):
    """The job ended while this node waited to be admitted (a spare that was not needed)."""

    def __init__(self, succeeded: bool, reason: str, exit_code: int | None = None) -> None:
        super().__init__(reason)
        self.succeeded = succeeded
        self.reason = reason
        # The exit code the node that ended the job chose (a crash loop's "do not
        # requeue"), so that every node exits with it; None: 0 or 1 as *succeeded* says.
        self.exit_code = exit_code


# A rank or node rank: never negative.
Index = Annotated[int, msgspec.Meta(ge=0)]


class _Record(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """What ended a node's round, as stored at ``r<n>/failure/<node rank>``.

    Every node reads every other's, from a store anyone on its port can write: the
    reader decodes it as ``FailureRecord`` (the tag in ``kind`` picks the type) and drops
    what does not fit."""

    node_rank: Index
    host: str = ""
    reason: str = ""

    def encode(self) -> bytes:
        return msgspec.json.encode(self)


class WorkerFailed(_Record, frozen=True, kw_only=True, tag="worker"):
    """A worker of the node died: the node's root-cause candidate."""

    local_rank: Index
    pid: int = 0
    exitcode: int = 0
    rank: Index | None = None
    signal: str | None = None
    timestamp: float = 0.0
    message: str = ""
    traceback: str = ""
    error_file: str = ""


class NodeLost(_Record, frozen=True, kw_only=True, tag="node_lost"):
    """A node stopped beating; a peer writes this on its behalf."""


class ShutdownRequested(_Record, frozen=True, kw_only=True, tag="shutdown"):
    """A rank asked to stop the job without restart."""

    pid: int = 0


class NodeExcluded(_Record, frozen=True, kw_only=True, tag="exclude_node"):
    """A rank asked to take its node out of the job; the others go on without it."""

    pid: int = 0


class NodesWaiting(_Record, frozen=True, kw_only=True, tag="nodes_waiting"):
    """Nodes wait to join a job running below MAX: the round ends so that the next one
    admits them (the job grows).  Nothing failed; no node is at fault."""

    waiting: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] = 1


FailureRecord = WorkerFailed | NodeLost | ShutdownRequested | NodeExcluded | NodesWaiting


def membership_change(records: tuple[FailureRecord, ...] | list[FailureRecord]) -> bool:
    """Whether a round ended only to admit waiting nodes (every record says so)."""
    return bool(records) and all(isinstance(r, NodesWaiting) for r in records)


#: Largest failure record read back from the store (bytes): a bounded record's text
#: (``bounded_failure``) in UTF-8 with room to spare; anything larger is not ours.
FAILURE_RECORD_LIMIT = 256 * 1024


def bounded_failure(rec: FailureRecord) -> FailureRecord:
    """*rec* with its text cut to the documented sizes (``base.records``), as it must
    be before it enters the store: every node reads every record, and a store value of
    megabytes stalls the store's one thread for everyone."""
    common = {"host": clip(rec.host, 256), "reason": clip(rec.reason, MESSAGE_LIMIT)}
    if isinstance(rec, WorkerFailed):
        return msgspec.structs.replace(
            rec,
            **common,
            message=clip(rec.message, MESSAGE_LIMIT),
            traceback=clip(rec.traceback, TRACEBACK_LIMIT),
            error_file=clip(rec.error_file, 4096),
            signal=None if rec.signal is None else clip(rec.signal, 64),
        )
    return msgspec.structs.replace(rec, **common)


def decode_failure(raw: bytes) -> FailureRecord:
    """One record from the store; ``msgspec.ValidationError`` (a ``DecodeError``) when it
    is not one of the kinds above, lacks what its kind needs, or is too large."""
    if len(raw) > FAILURE_RECORD_LIMIT:
        raise msgspec.ValidationError(
            f"a record of {len(raw)} bytes (the limit is {FAILURE_RECORD_LIMIT})"
        )
    rec: FailureRecord = msgspec.json.decode(raw, type=FailureRecord)
    return rec


@dataclass(frozen=True)
class RendezvousInfo:
    """One node's view of a completed round."""

    round: int
    group_rank: int
    group_world_size: int
    base_rank: int  # global rank of this node's local rank 0
    world_size: int
    master_addr: str
    master_port: int
    duration: float  # seconds spent waiting for the other nodes
    # Nodes of the previous round that are not in this one ("host (node rank N)").
    left: tuple[str, ...] = ()


class Rendezvous(Protocol):
    run_id: str
    node_rank: int | None
    # Whether the job can go on without a node (MIN:MAX membership): a rank's request to
    # exclude its node then removes the node; with fixed membership it ends the job.
    elastic: bool

    def join(self, round_: int, local_world_size: int) -> RendezvousInfo:
        """Blocks until the nodes of a round have joined; returns ranks and the worker store.

        The round may be later than *round_*: a node that arrives while the job runs is a
        spare and is admitted at the next restart boundary."""
        ...

    def report_failure(self, round_: int, failure: FailureRecord) -> None:
        """Tells every node that *round_* failed (this node's root-cause candidate)."""
        ...

    def failed(self, round_: int) -> bool:
        """True once any node reported a failure in *round_* (cheap: polled often)."""
        ...

    def failures(self, round_: int) -> list[FailureRecord]:
        """The failure records of every node that reported one in *round_*."""
        ...

    @property
    def name(self) -> str:
        """This node as the quarantine ledger names it (``node_names`` names the others)."""
        ...

    def node_names(self, round_: int) -> tuple[str, ...]:
        """The nodes of *round_* by node rank, named as ``name`` names this one."""
        ...

    def withdraw(self) -> int:
        """This node leaves the job for good before its next round (it is quarantined);
        returns how many other nodes remain in the job to go on without it."""
        ...

    def waiting(self, round_: int) -> int:
        """How many nodes wait to join the round after *round_* that the job could admit
        (alive, not kept out, up to MAX): while *round_* runs, a positive answer means
        ending it would grow the job.  Cheap: polled often (it may answer from a recent
        look)."""
        ...

    def report_done(self, round_: int) -> None:
        """This node's workers all succeeded in *round_*."""
        ...

    def all_done(self, round_: int) -> bool: ...

    def finish(self, succeeded: bool, reason: str, exit_code: int | None = None) -> None:
        """The job is over (success, or no restart left): nodes waiting to join a round
        (spares, or peers that would restart) exit, with *exit_code* when one is given."""
        ...

    def interrupt(self) -> None:
        """A signal reached the launcher while it leaves: stop any wait in ``leave``."""
        ...

    def leave(self) -> None:
        """This node is exiting; the store host waits for everyone before closing."""
        ...
