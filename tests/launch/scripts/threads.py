"""Writes the intra-op thread count this worker runs with to $1/threads_<RANK>."""

import os
import sys

import torch

with open(os.path.join(sys.argv[1], f"threads_{os.environ['RANK']}"), "w") as fh:
    fh.write(str(torch.get_num_threads()))
