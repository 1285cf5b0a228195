"""Node health: keeping bad nodes out of a job's rounds.

The launcher calls this package; it knows nothing of the launcher. The parts:

* `local` — what one node measures of itself (compute, memory, disk, its interface);
* `usercheck` — the user's own command, bounded in time and output;
* `probe` — a bounded echo server each node runs, and the client that times a link;
* `records` — the signed report a node leaves in the store, and the verdict;
* `judge` — the pure decision: which nodes are slow or broken, compared with their peers;
* `admission` — the gate the rendezvous asks: may this node join this round?
* `gpu` — a stock ``--node-health-check`` for GPU nodes;
* `quarantine`, `ledger`, `guard` — the quarantine of nodes that keep failing
  (``quarantine`` decides, ``ledger`` keeps the job-wide record in the rendezvous store).
"""
