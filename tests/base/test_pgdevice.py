"""Where stalwart's own collectives put their tensors, by the group's backend name."""

from __future__ import annotations

import pytest

from stalwart.base.pgdevice import device_type_for

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("backend", "accelerator", "expected"),
    [
        ("gloo", "cuda", "cpu"),
        ("GLOO", "cuda", "cpu"),
        ("mpi", "cuda", "cpu"),
        ("ucc", "cuda", "cpu"),
        # NCCL alone (init_process_group("nccl")) refuses CPU tensors: the load_newest
        # agreement failed there with "No backend type associated with device type cpu".
        ("nccl", "cuda", "cuda"),
        ("cpu:gloo,cuda:nccl", "cuda", "cpu"),
        ("cuda:nccl,cpu:gloo", "cuda", "cpu"),
        ("cuda:nccl", "cuda", "cuda"),
        ("xpu:xccl", "xpu", "xpu"),
        ("xccl", "xpu", "xpu"),
        ("", "cuda", "cpu"),
    ],
)
def test_device_type_for_backend_table(backend: str, accelerator: str, expected: str) -> None:
    assert device_type_for(backend, accelerator) == expected


def test_a_gloo_group_takes_cpu_tensors() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import TCPStore

    from stalwart.base.pgdevice import group_device

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert group_device() == torch.device("cpu")
    finally:
        dist.destroy_process_group()
