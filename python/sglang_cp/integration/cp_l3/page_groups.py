"""Page starts of a storage transfer, validated at the boundary between upstream index
tensors and our copies.

Seed item: ``validate_page_aligned_token_indices`` -- reject malformed (partial,
misaligned, non-contiguous) page groups before they reach native transfer code. The
check itself is shared with the seed-parity hooks (``sglang_cp.compute.page_groups``);
here it guards the L3 backend: every page it copies must be exactly ``page_size``
consecutive slots starting on a page boundary. A violation is a broken invariant
upstream, so it fails loud instead of copying the wrong rows.

A contiguous CPU int64 tensor (upstream's host indices) is checked by one C loop that keeps the GIL
(``sglang_cp.l3.native.page_starts``): the torch checks below go through the dispatcher, and each of their
~14 ops releases the GIL, which beside a busy scheduler thread costs up to CPython's 5 ms switch interval
(60-100 ms per prefetch, ``docs_internal/figures.md``). Any other tensor, a group that fails the C check
(to name it), or an installation without the native library takes the torch checks.
"""

from __future__ import annotations

import torch

from sglang_cp.compute.page_groups import PageGroupError, validate_page_aligned_token_indices
from sglang_cp.l3.native import page_starts

__all__ = ["PageGroupError", "validate_page_aligned"]


def validate_page_aligned(indices: torch.Tensor, page_size: int, n_pages: int) -> list[int]:
    """Return the first slot of each of ``n_pages`` pages; raise PageGroupError otherwise."""
    if indices is None:
        raise PageGroupError("host indices are missing for a storage transfer")
    if (indices.device.type == "cpu" and indices.dtype == torch.int64 and indices.is_contiguous()
            and indices.numel() == n_pages * page_size):
        starts = page_starts(indices.data_ptr(), n_pages, page_size)  # the tensor stays alive meanwhile
        if starts is not None:
            return starts
    flat = indices.reshape(-1).to("cpu", dtype=torch.int64)
    if flat.numel() != n_pages * page_size:
        raise PageGroupError(
            f"{flat.numel()} token slots for {n_pages} pages of {page_size}: a partial page "
            f"reached the storage path")
    validate_page_aligned_token_indices(flat, page_size, name="storage host_indices")
    return flat[::page_size].tolist()
