"""Page-group validation at the boundary between upstream index tensors and our copies.

Seed item: ``validate_page_aligned_token_indices`` -- reject malformed (partial,
misaligned, non-contiguous) page groups before they reach native transfer code. Upstream
hands the storage backend flat token-slot tensors; every page we copy must be exactly
``page_size`` consecutive slots starting on a page boundary. A violation is a broken
invariant upstream, so it fails loud here instead of copying the wrong rows.
"""

from __future__ import annotations

import torch


class PageGroupError(ValueError):
    pass


def validate_page_aligned(indices: torch.Tensor, page_size: int, n_pages: int) -> list[int]:
    """Return the first slot of each page; raise PageGroupError on a malformed group."""
    if indices is None:
        raise PageGroupError("host indices are missing for a storage transfer")
    flat = indices.reshape(-1)
    if flat.numel() != n_pages * page_size:
        raise PageGroupError(
            f"{flat.numel()} token slots for {n_pages} pages of {page_size}: a partial page "
            f"reached the storage path")
    if n_pages == 0:
        return []
    pages = flat.to("cpu", dtype=torch.int64).view(n_pages, page_size)
    starts = pages[:, 0]
    if bool((starts % page_size != 0).any()):
        bad = int(torch.nonzero(starts % page_size != 0)[0, 0])
        raise PageGroupError(f"page {bad} starts at slot {int(starts[bad])}, not a multiple of {page_size}")
    expected = starts.unsqueeze(1) + torch.arange(page_size, dtype=torch.int64)
    if not torch.equal(pages, expected):
        bad = int(torch.nonzero((pages != expected).any(dim=1))[0, 0])
        raise PageGroupError(f"page {bad} is not {page_size} consecutive slots")
    return starts.tolist()
