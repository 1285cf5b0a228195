"""A worker that records when it is ready to work: started, torch imported (as every
PyTorch worker does first), for the rendezvous benchmark."""

import os
import sys
import time

import torch  # noqa: F401

with open(os.path.join(sys.argv[1], f"stamp_{os.environ['RANK']}"), "w") as fh:
    fh.write(repr(time.time()))
