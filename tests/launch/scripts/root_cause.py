"""Rank 1 raises first; rank 0 notices later and exits with its own error."""

import os
import time

from stalwart.launch.workers.errors import record


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    if rank == 1:
        raise ValueError("rank one broke first")
    time.sleep(0.5)
    raise RuntimeError("rank zero saw its peer die")


main()
