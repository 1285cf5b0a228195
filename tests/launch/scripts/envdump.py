"""Writes the torchrun-style variables this worker sees to $OUT_DIR/env_<RANK>.json."""

import json
import os
import sys

PREFIXES = ("TORCH", "RANK", "LOCAL_", "GROUP_", "ROLE_", "WORLD_", "MASTER_", "OMP_")
env = {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)}
out = os.path.join(sys.argv[1], f"env_{os.environ['RANK']}.json")
with open(out, "w") as fh:
    json.dump(env, fh)
