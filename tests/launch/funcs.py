"""Worker functions for the Python API tests (importable, so ``spawn`` can find them)."""

from __future__ import annotations

import os
import sys
import time


def square(x: int) -> int:
    print(f"square of {x}", flush=True)
    return x * x


def rank_info() -> dict[str, str]:
    return {"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"]}


def fail_on_one(x: int) -> int:
    if os.environ["LOCAL_RANK"] == "1":
        raise ValueError(f"bad input {x}")
    return x


def sleep_forever() -> None:
    while True:
        time.sleep(0.05)


def big_value(n: int) -> bytes:
    return b"x" * n


def write_both() -> None:
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    os.write(1, b"raw fd write\n")
