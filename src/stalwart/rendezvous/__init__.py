"""Rendezvous: which nodes form the job this round, and where the workers' store lives.

The supervisor talks to a ``Rendezvous`` only; a backend (c10d ``TCPStore`` today, etcd
later) decides how nodes meet.  Rounds are job-wide: round *n* is attempt *n* on every
node, so ``TORCHELASTIC_RESTART_COUNT`` and the restart budget agree across nodes.
"""

from stalwart.rendezvous.api import Rendezvous, RendezvousError, RendezvousInfo
from stalwart.rendezvous.c10d import C10dRendezvous, StoreEndpoint
from stalwart.rendezvous.factory import from_config

__all__ = [
    "C10dRendezvous",
    "Rendezvous",
    "RendezvousError",
    "RendezvousInfo",
    "StoreEndpoint",
    "from_config",
]
