"""Rendezvous: which nodes form the job this round, and where the workers' store lives.

The supervisor talks to a ``Rendezvous`` only; a backend decides how nodes meet: static
membership through node 0's c10d ``TCPStore`` (`StaticRendezvous`), or elastic
``MIN:MAX`` membership with keep-alive on a ``TCPStore`` or an etcd cluster
(`ElasticRendezvous`).  Rounds are job-wide: round *n* is attempt *n* on every node, so
``TORCHELASTIC_RESTART_COUNT`` and the restart budget agree across nodes.  This package
knows nothing of the launcher's settings: ``launch/round/membership.py`` translates them.
"""

from stalwart.rendezvous.api import (
    FailureRecord,
    JobEnded,
    NodeExcluded,
    NodeLost,
    NodesWaiting,
    Rendezvous,
    RendezvousError,
    RendezvousInfo,
    ShutdownRequested,
    StoreLost,
    WorkerFailed,
    decode_failure,
    membership_change,
)
from stalwart.rendezvous.close_rule import ElasticSettings
from stalwart.rendezvous.elastic import ElasticRendezvous
from stalwart.rendezvous.static import StaticRendezvous, StoreEndpoint

__all__ = [
    "ElasticRendezvous",
    "ElasticSettings",
    "FailureRecord",
    "JobEnded",
    "NodeExcluded",
    "NodeLost",
    "NodesWaiting",
    "Rendezvous",
    "RendezvousError",
    "RendezvousInfo",
    "ShutdownRequested",
    "StaticRendezvous",
    "StoreEndpoint",
    "StoreLost",
    "WorkerFailed",
    "decode_failure",
    "membership_change",
]
