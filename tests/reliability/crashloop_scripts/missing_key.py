# A training script that never heard of stalwart, without a __main__ guard: rank 1
# fails the same way in every attempt, before any step.
import os

import torch.distributed as dist

if os.environ["RANK"] == "1":
    raise ValueError("config key 'lr' missing")
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
