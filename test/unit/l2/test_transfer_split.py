"""No transfer group may touch two slabs: checked byte by byte against the plan."""

import numpy as np
import pytest
import torch

from sglang_cp.l2.page_copy import copy_pages, page_runs, plan_copies
from sglang_cp.l2.slab_plan import plan_slabs
from sglang_cp.l2.transfer_split import SlabSplitter, TokenAxis, split_byte_range, token_cuts

MiB = 1 << 20
HP = 2 * MiB
PAGE = 64


def geometry(layout, row, layers, pages):
    """(nbytes, unit, TokenAxis, byte offset fn(layer, token)) as upstream lays pools out."""
    size = pages * PAGE
    if layout == "layer_first":  # [layer, token, row]
        axis = TokenAxis(layers, size * row, row, 1)
        return size * row * layers, PAGE * row, axis, lambda l, t: l * size * row + t * row
    if layout == "page_first":  # [token, layer, row]
        axis = TokenAxis(1, size * row * layers, row * layers, 1)
        return size * row * layers, PAGE * row * layers, axis, lambda l, t: t * row * layers + l * row
    if layout == "dsa_layer_first":  # [layer, page, page_stride]
        stride = PAGE * row
        axis = TokenAxis(layers, pages * stride, stride, PAGE)
        return pages * stride * layers, stride, axis, lambda l, t: l * pages * stride + (t // PAGE) * stride + (t % PAGE) * row
    raise ValueError(layout)


CASES = [
    ("layer_first", 1152, 6, 700, 20 * MiB),  # MLA bf16: unit 72 KiB, slabs of 18 MiB
    ("layer_first", 656, 5, 900, 90 * MiB),  # MLA fp8: lcm(41984, 2 MiB) = 82 MiB
    ("page_first", 1152, 3, 600, 60 * MiB),  # unit 216 KiB: lcm(221184, 2 MiB) = 54 MiB
    ("dsa_layer_first", 132, 7, 1200, 70 * MiB),  # unit 8448 B, lcm 66 MiB
]


@pytest.mark.parametrize("layout,row,layers,pages,cap", CASES)
def test_every_group_stays_in_one_slab_for_every_layer(layout, row, layers, pages, cap):
    nbytes, unit, axis, at = geometry(layout, row, layers, pages)
    plan = plan_slabs("p", nbytes, unit, HP, cap)
    assert len(plan.slabs) >= 2, "the case must cross slab boundaries"
    cuts = token_cuts(plan, axis)
    assert cuts, "layer_first and page-major pools of several slabs cut the token axis"
    assert all(c % PAGE == 0 for c in cuts), "cuts fall on page boundaries"
    splitter = SlabSplitter(cuts)

    g = torch.Generator().manual_seed(7)
    chosen = torch.randperm(pages, generator=g)[: pages // 2]
    host = (chosen[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    device = torch.arange(host.numel()) + 10_000
    seen = 0
    groups = list(splitter.split(host, device))
    assert len(groups) > 1
    for h, d in groups:
        assert h.numel() % PAGE == 0 and h.numel() == d.numel()
        assert torch.equal(d - 10_000, torch.nonzero(torch.isin(host, h)).flatten()), "pairs kept, order kept"
        for layer in range(layers):
            first = plan.slab_of(at(layer, int(h.min())))
            for t in h.tolist()[:: PAGE // 4] + [int(h.max())]:
                lo, hi = at(layer, t), at(layer, t) + row - 1
                assert plan.slab_of(lo) == first and plan.slab_of(hi) == first
        seen += h.numel()
    assert seen == host.numel()


def test_a_boundary_between_layers_cuts_nothing():
    # Layer rows of exactly 18 MiB: slab boundaries fall between layers, not inside them.
    row, layers = 1152, 4
    pages = (18 * MiB) // (PAGE * row)
    nbytes, unit, axis, _ = geometry("layer_first", row, layers, pages)
    plan = plan_slabs("p", nbytes, unit, HP, 18 * MiB)
    assert len(plan.slabs) == layers
    assert token_cuts(plan, axis) == []
    assert SlabSplitter([]).trivial


def test_single_slab_and_empty_transfers_pass_through():
    s = SlabSplitter([PAGE * 10])
    h = torch.arange(PAGE * 3)
    assert [(a is h) for a, _ in s.split(h, h)] == [True]
    e = torch.empty(0, dtype=torch.int64)
    assert len(list(s.split(e, e))) == 1


def test_split_byte_range():
    assert split_byte_range(0, 100, [40, 80]) == [(0, 40), (40, 40), (80, 20)]
    assert split_byte_range(40, 40, [40, 80]) == [(40, 40)]
    assert split_byte_range(10, 5, [40]) == [(10, 5)]


def test_page_runs_merge_only_when_both_sides_are_consecutive():
    assert page_runs(np.array([3, 4, 5, 9, 10]), np.array([0, 1, 7, 8, 9])) == [(3, 0, 2), (5, 7, 1), (9, 8, 2)]
    assert page_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []


def test_planned_copies_are_byte_exact_and_never_straddle():
    page_bytes = 3 * 4096
    boundaries = [page_bytes * 5, page_bytes * 11]
    host = torch.randint(0, 256, (page_bytes * 16,), dtype=torch.uint8)
    dev = torch.zeros(page_bytes * 16, dtype=torch.uint8)
    hp = np.array([2, 3, 4, 5, 6, 7, 14, 9, 10, 11, 12])
    dp = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    copies = plan_copies(hp, dp, page_bytes, boundaries)
    for h, _, n in copies:
        assert not any(h < b < h + n for b in boundaries)
    assert copy_pages(host, dev, copies, to_device=True) == len(hp) * page_bytes
    for h, d in zip(hp, dp):
        assert torch.equal(dev[d * page_bytes:(d + 1) * page_bytes], host[h * page_bytes:(h + 1) * page_bytes])
    back = torch.zeros_like(host)
    copy_pages(back, dev, copies, to_device=False)
    for h in hp:
        assert torch.equal(back[h * page_bytes:(h + 1) * page_bytes], host[h * page_bytes:(h + 1) * page_bytes])
