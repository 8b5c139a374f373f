"""Page starts of a storage transfer, validated at the boundary between upstream index
tensors and our copies.

Seed item: ``validate_page_aligned_token_indices`` -- reject malformed (partial,
misaligned, non-contiguous) page groups before they reach native transfer code. The
check itself is shared with the seed-parity hooks (``sglang_cp.compute.page_groups``);
here it guards the L3 backend: every page it copies must be exactly ``page_size``
consecutive slots starting on a page boundary. A violation is a broken invariant
upstream, so it fails loud instead of copying the wrong rows.
"""

from __future__ import annotations

import torch

from sglang_cp.compute.page_groups import PageGroupError, validate_page_aligned_token_indices

__all__ = ["PageGroupError", "validate_page_aligned"]


def validate_page_aligned(indices: torch.Tensor, page_size: int, n_pages: int) -> list[int]:
    """Return the first slot of each of ``n_pages`` pages; raise PageGroupError otherwise."""
    if indices is None:
        raise PageGroupError("host indices are missing for a storage transfer")
    flat = indices.reshape(-1).to("cpu", dtype=torch.int64)
    if flat.numel() != n_pages * page_size:
        raise PageGroupError(
            f"{flat.numel()} token slots for {n_pages} pages of {page_size}: a partial page "
            f"reached the storage path")
    validate_page_aligned_token_indices(flat, page_size, name="storage host_indices")
    return flat[::page_size].tolist()
