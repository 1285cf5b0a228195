"""Every key the rendezvous backends keep in their ``KV`` engine, named once.

Job-wide keys:

* ``run_id``: the job this store belongs to (the host, or the first node, writes it);
* ``job/ended``: written once when the job is over, so spares waiting to join stop;
* ``hb/<node id>``: a node's keep-alive counter (elastic);
* ``left/<node id>``: a node left the job (elastic; static: ``<node id>`` is its rank);
* ``node_counter``: hands out node ranks in order of arrival (static, no ``--node-rank``).

Per-round keys, under ``r<n>/`` (``Round``):

* ``joined`` counter hands out slots; ``node/<slot>`` describes the node (elastic);
* ``nproc/<node rank>``: how many workers the node runs (static);
* ``closed``: the admitted slots in rank order, written once (elastic);
* ``master``: where the workers' store of the round listens;
* ``failure/<node rank>`` then ``failed``: a node's account of a failed round, then the
  flag every node polls;
* ``done/<node rank>``: a node's workers all succeeded (a key per node, never a
  counter: a counter carries no MAC, and a non-number written to one makes the store
  drop the next client that adds to it);
* ``implicated/<node rank>``: which node a failed round points at, as the node of that
  rank saw it (the quarantine ledger, ``health/ledger.py``; MACed by the job's key).
"""

from __future__ import annotations

from dataclasses import dataclass

RUN_ID = "run_id"
JOB_ENDED = "job/ended"
NODE_COUNTER = "node_counter"


def heartbeat(node_id: str) -> str:
    return f"hb/{node_id}"


def left(node_id: str) -> str:
    return f"left/{node_id}"


@dataclass(frozen=True)
class Round:
    """The keys of round *n*."""

    n: int

    @property
    def _p(self) -> str:
        return f"r{self.n}/"

    @property
    def joined(self) -> str:
        return f"{self._p}joined"

    @property
    def closed(self) -> str:
        return f"{self._p}closed"

    @property
    def master(self) -> str:
        return f"{self._p}master"

    @property
    def failed(self) -> str:
        return f"{self._p}failed"

    def node(self, slot: int) -> str:
        return f"{self._p}node/{slot}"

    def nproc(self, node_rank: int) -> str:
        return f"{self._p}nproc/{node_rank}"

    def failure(self, node_rank: int) -> str:
        return f"{self._p}failure/{node_rank}"

    def done(self, node_rank: int) -> str:
        return f"{self._p}done/{node_rank}"

    def implicated(self, node_rank: int) -> str:
        return f"{self._p}implicated/{node_rank}"
