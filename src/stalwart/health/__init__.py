"""Node health: the checks a node runs before it joins a round, and who is kept out.

The launcher calls this package; it knows nothing of the launcher. The parts:

* `local` — what one node measures of itself (compute, memory, disk, its interface);
* `usercheck` — the user's own command, bounded in time and output;
* `probe` — a bounded echo server each node runs, and the client that times a link;
* `records` — the signed report a node leaves in the store, and the verdict;
* `judge` — the pure decision: which nodes are slow or broken, compared with their peers;
* `admission` — the gate the rendezvous asks: may this node join this round?
"""
