"""Staging DCP saves straight into the writer's shared buffer (one copy, not two): which
tensors a snapshot may write from where they are, the arena's layout, and that the lent
memory never goes away under a view of it. Pure, no processes."""

from __future__ import annotations

import pytest
import torch

from stalwart.checkpoint.dcp_stager import arena_layout
from stalwart.checkpoint.staging import PAGE_ALIGN, BufferView, SharedBuffer, plan

pytestmark = pytest.mark.timeout(60)


def test_only_whole_contiguous_tensors_inside_the_lent_region_are_written_in_place() -> None:
    buf = SharedBuffer()
    try:
        head = buf.lend(8192)
        region = buf.lend(4096)  # lent again, shorter: [4096, 8192) is no longer lent
        assert region.data_ptr() == head.data_ptr() and buf.lent is region
        whole = head[64:464].view(torch.float32)  # 100 floats inside
        whole.copy_(torch.arange(100.0))
        prefix = whole[:10]  # the same start, fewer bytes: a different tensor
        straddling = head[4032:4160].view(torch.float32)  # crosses the region's end
        beyond = head[5000:5040].view(torch.float32)
        strided = head[:4096].view(torch.float32).view(32, 32)[:, ::2]
        own = torch.arange(7.0)
        state = {
            "whole": whole,
            "prefix": prefix,
            "straddling": straddling,
            "beyond": beyond,
            "strided": strided,
            "own": own,
            "again": whole,  # the same tensor twice: one ref
        }
        staged = plan(state, region)
        assert staged.in_place_bytes == 400 + 40
        assert {id(src) for src, _, _ in staged.copies} == {
            id(t) for t in (straddling, beyond, strided, own)
        }
        # Copies go after the lent region, never over it.
        assert all(ref.offset >= 4096 for _, ref, _ in staged.copies)
        assert staged.used_bytes >= 4096 and staged.in_place is None  # no view kept
        # What the writer reads back (sources past the region are left out: the copies
        # land there).
        for name in ("straddling", "beyond"):
            del state[name]
        got = BufferView(buf.fd).unstage(buf.copy_in(plan(state, region)))
        assert torch.equal(got["whole"], torch.arange(100.0))
        assert torch.equal(got["prefix"], torch.arange(10.0))  # not the whole one again
        assert got["again"] is got["whole"]
        for name in ("strided", "own"):
            assert torch.equal(got[name], state[name]), name
    finally:
        buf.close()


def test_a_lent_view_outlives_the_buffer_growing_and_closing() -> None:
    buf = SharedBuffer()
    view = buf.lend(1 << 20).view(torch.int32)
    view.copy_(torch.arange(view.numel(), dtype=torch.int32))
    buf.ensure(64 << 20)  # remapped: the old mapping must stay while the view lives
    assert buf.capacity >= 64 << 20
    assert torch.equal(view, torch.arange(view.numel(), dtype=torch.int32))
    buf.close()
    view.add_(1)  # written after close: still mapped memory of ours
    assert int(view[-1]) == view.numel()
    with pytest.raises(RuntimeError, match="closed"):
        buf.lend(10)
    with pytest.raises(ValueError, match="nbytes=-1"):
        SharedBuffer().lend(-1)


@pytest.mark.parametrize(
    ("sizes", "offsets", "end"),
    [
        ([], [], 0),
        ([0, 0], [0, 0], 0),
        ([3, 5], [0, 64], 69),
        ([10, 1 << 16], [0, PAGE_ALIGN], PAGE_ALIGN + (1 << 16)),  # large: on a page
        ([1 << 16, 1], [0, 1 << 16], (1 << 16) + 1),
    ],
)
def test_arena_layout(sizes: list[int], offsets: list[int], end: int) -> None:
    assert arena_layout(sizes) == (offsets, end)


def test_arena_layout_refuses_a_negative_size() -> None:
    with pytest.raises(ValueError, match="-4 bytes"):
        arena_layout([8, -4])
