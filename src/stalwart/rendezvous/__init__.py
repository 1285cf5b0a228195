"""Rendezvous: which nodes form the job this round, and where the workers' store lives.

The supervisor talks to a ``Rendezvous`` only; a backend decides how nodes meet: static
membership through node 0's c10d ``TCPStore``, or elastic ``MIN:MAX`` membership with
keep-alive on a ``TCPStore`` or an etcd cluster.  Rounds are job-wide: round *n* is
attempt *n* on every node, so ``TORCHELASTIC_RESTART_COUNT`` and the restart budget agree
across nodes.
"""

from stalwart.rendezvous.api import (
    FailureRecord,
    JobEnded,
    NodeExcluded,
    NodeLost,
    Rendezvous,
    RendezvousError,
    RendezvousInfo,
    ShutdownRequested,
    StoreLost,
    WorkerFailed,
    decode_failure,
)
from stalwart.rendezvous.c10d import C10dRendezvous, StoreEndpoint
from stalwart.rendezvous.elastic import ElasticRendezvous, ElasticSettings
from stalwart.rendezvous.factory import from_config

__all__ = [
    "C10dRendezvous",
    "ElasticRendezvous",
    "ElasticSettings",
    "FailureRecord",
    "JobEnded",
    "NodeExcluded",
    "NodeLost",
    "Rendezvous",
    "RendezvousError",
    "RendezvousInfo",
    "ShutdownRequested",
    "StoreEndpoint",
    "StoreLost",
    "WorkerFailed",
    "decode_failure",
    "from_config",
]
