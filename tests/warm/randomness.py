"""Records the random values a worker draws at start (unseeded, or seeded with "seeded");
attempt 0 fails once both ranks have written, so that attempt 1 draws again."""

import json
import os
import random
import sys
import time

import numpy as np
import torch

out, how = sys.argv[1], sys.argv[2]
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
if how == "seeded":
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
info = {
    "torch_initial_seed": torch.initial_seed(),
    "torch": torch.randint(0, 2**62, (4,)).tolist(),
    "numpy": np.random.randint(0, 2**62, 4).tolist(),
    "random": [random.getrandbits(62) for _ in range(4)],
    "hash": hash("abc"),
}
name = os.path.join(out, f"rand_{rank}_{attempt}.json")
with open(name + ".tmp", "w") as fh:
    json.dump(info, fh)
os.rename(name + ".tmp", name)
if attempt == "0":
    deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(out, f"rand_{r}_0.json")) for r in (0, 1)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    sys.exit(3)
