"""Writes (to $PROBE_OUT/main_<mode>.json) what a program sees of its ``__main__``, run as
a script or with ``-m``, to compare ``python -u`` with a worker of ``stalwart run``."""

import atexit
import json
import os
import sys

here = sys.modules[__name__]
info = {
    "name": __name__,
    "file": __file__,
    "argv0": sys.argv[0],
    "path0": sys.path[0],
    "spec": None if __spec__ is None else [__spec__.name, __spec__.origin],
    "package": __package__,
    "loader": type(__loader__).__name__,
    "cached": __cached__,
    "globals": sorted(k for k in globals() if k.startswith("__")),
    "builtins_is_module": isinstance(__builtins__, type(sys)),
    "annotations": globals().get("__annotations__"),
}


def _at_exit() -> None:
    # The interpreter keeps the program's module as __main__ to the end.
    info["main_at_exit"] = sys.modules["__main__"] is here
    out = os.path.join(os.environ["PROBE_OUT"], f"main_{os.environ['PROBE_MODE']}.json")
    with open(out, "w") as fh:
        json.dump(info, fh)


atexit.register(_at_exit)
