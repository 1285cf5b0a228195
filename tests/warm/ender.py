"""Imports what the warm template holds, waits for a go file, then records the moment
its last line runs (``end_<tag>``, with the number of objects the final collections
skip because they are frozen) and ends normally: what is left is the interpreter's own
shutdown."""

import gc
import json
import os
import sys
import time

import torch
import torch._dynamo
import torch.distributed
import torch.nn.parallel

out, tag = sys.argv[1], sys.argv[2]
torch.ones(4).sum()
open(os.path.join(out, f"ready_{tag}"), "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
    time.sleep(0.01)
with open(os.path.join(out, f"end_{tag}"), "w") as fh:
    json.dump({"end": time.time(), "frozen": gc.get_freeze_count()}, fh)
