"""Rank 1 of the first attempt raises an exception with a 5 MB message; then all succeed.

argv: OUT
"""

import os

from stalwart.launch.workers.errors import record


@record
def main() -> None:
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
        raise RuntimeError("boom " + "x" * (5 << 20) + " \x1b[2J end")


main()
