"""Fails with an uncaught exception two calls deep, after printing its command line."""

import json
import sys


def inner() -> None:
    raise ValueError("failing on purpose")


def outer() -> None:
    inner()


print(json.dumps({"argv": sys.argv, "orig_argv": sys.orig_argv}), flush=True)
outer()
