"""Runs examples/train_ddp.py with NVIDIA's RankMonitorClient in place of stalwart's, as
a script written against nvidia-resiliency-ext would (the "import line changed" case).

    ft_launcher ... bench/nv_client_shim.py --heartbeat ...
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

import stalwart.monitor

stalwart.monitor.RankMonitorClient = RankMonitorClient  # type: ignore[misc]
example = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"
sys.argv[0] = str(example)
runpy.run_path(str(example), run_name="__main__")
