"""Names of the environment variables through which a launcher hands monitoring to workers.

This module owns the spelling of every variable; both sides import the names from here
so that the launcher and the worker-side clients can never disagree.
"""

from __future__ import annotations

#: Path of the node's timer named pipe (stalwart's own name).
TIMER_FILE = "STALWART_TIMER_FILE"
#: torch elastic's name for the same pipe; honoured so FileTimerClient users work unchanged.
TORCHELASTIC_TIMER_FILE = "TORCHELASTIC_TIMER_FILE"
#: Path of the shared-memory segment holding one slot per local rank.
SHM_FILE = "STALWART_MONITOR_SHM"
#: Index of this worker's slot in the segment (the local rank).
SLOT = "STALWART_MONITOR_SLOT"
#: Global rank of this worker, recorded in control requests.
GLOBAL_RANK = "STALWART_MONITOR_GLOBAL_RANK"
#: Safety factor applied to learned timeouts.
SAFETY_FACTOR = "STALWART_MONITOR_SAFETY_FACTOR"
#: When "1", a client that finds no monitor raises instead of warning and doing nothing.
STRICT = "STALWART_MONITOR_STRICT"
#: The node's configured timeouts (JSON), so a client can report the timeouts in force.
TIMEOUTS = "STALWART_MONITOR_TIMEOUTS"
#: File (in the rank's log folder) where the stack dump goes instead of stderr,
#: so dumps of several hung ranks never interleave on a shared console.
STACKS_FILE = "STALWART_STACKS_FILE"
#: NVIDIA's variable naming the rank's own monitor (RankMonitorServer.run_in_subprocess);
#: a client outside `stalwart run` attaches to the segment at that path.
NVIDIA_IPC_SOCKET = "FT_RANK_MONITOR_IPC_SOCKET"
