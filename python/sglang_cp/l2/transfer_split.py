"""Split host transfers so that no single copy spans two slabs (two registrations).

A pool tensor is ``outer`` rows (layers for layer_first, one row for page-major
layouts) of ``row_bytes`` each, and a host token index ``t`` lands at step
``t // tokens_per_step`` of every row. A slab boundary at byte ``b`` cuts the token
axis at ``(b % row_bytes) / step_bytes`` steps -- or nowhere, when it falls exactly
between rows. Grouping the transfer's indices by the interval between consecutive
cuts gives groups in which, for every layer, all bytes touched lie in one slab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from sglang_cp.l2.slab_plan import SlabPlan


@dataclass(frozen=True)
class TokenAxis:
    outer: int  # rows before the token axis (layers for layer_first; 1 for page-major)
    row_bytes: int  # bytes of one such row
    step_bytes: int  # bytes of one step along the indexed axis
    tokens_per_step: int  # host token indices per step (1, or page_size for page rows)

    def __post_init__(self):
        if self.row_bytes % self.step_bytes:
            raise ValueError(f"row of {self.row_bytes} B is not whole {self.step_bytes}-B steps")


def token_cuts(plan: SlabPlan, axis: TokenAxis) -> list[int]:
    """Sorted host token indices at which some slab boundary cuts the token axis."""
    if axis.outer * axis.row_bytes != plan.nbytes:
        raise ValueError(
            f"token axis covers {axis.outer} x {axis.row_bytes} B but pool {plan.label!r} has {plan.nbytes} B"
        )
    cuts = set()
    for b in plan.boundaries():
        within = b % axis.row_bytes
        if within == 0:
            continue
        if within % axis.step_bytes:
            # The plan promised page-unit boundaries; a cut inside a step breaks that promise.
            raise AssertionError(
                f"slab boundary {b} of pool {plan.label!r} falls inside a {axis.step_bytes}-B step"
            )
        cuts.add(within // axis.step_bytes * axis.tokens_per_step)
    return sorted(cuts)


class SlabSplitter:
    """Partition (host, device) index pairs into groups that each stay within one slab."""

    def __init__(self, cuts: Sequence[int]):
        self.cuts = list(cuts)
        self._cuts_t = torch.tensor(self.cuts, dtype=torch.int64)

    @property
    def trivial(self) -> bool:
        return not self.cuts

    def bucket_of(self, host_indices: torch.Tensor) -> torch.Tensor:
        cuts = self._cuts_t.to(host_indices.device)
        return torch.bucketize(host_indices.to(torch.int64), cuts, right=True)

    def split(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> Iterator[tuple]:
        """Yield (host, device) index pairs per slab interval, order kept inside each."""
        if self.trivial or host_indices.numel() == 0:
            yield host_indices, device_indices
            return
        buckets = self.bucket_of(host_indices)
        present = torch.unique(buckets).tolist()
        if len(present) == 1:
            yield host_indices, device_indices
            return
        for b in present:
            mask = buckets == b
            yield host_indices[mask], device_indices[mask]


def split_byte_range(offset: int, length: int, boundaries: Sequence[int]) -> list[tuple[int, int]]:
    """Cut [offset, offset+length) at the given sorted slab boundaries."""
    out = []
    end = offset + length
    for b in boundaries:
        if b <= offset:
            continue
        if b >= end:
            break
        out.append((offset, b - offset))
        offset = b
    if end > offset:
        out.append((offset, end - offset))
    return out
