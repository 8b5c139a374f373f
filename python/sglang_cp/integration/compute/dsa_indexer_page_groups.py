"""Hook point: ``sglang.srt.mem_cache.pool_host.dsa.DSAIndexerPoolHost._get_indexer_page_indices``.

Why: every DSA indexer-K host<->device transfer (load_to_device_per_layer,
backup_from_device_all_layer) turns token indices into page ids here by taking
the first index of each ``page_size`` group and dividing. Upstream 0.5.23 only
checks the count, so a misaligned or non-contiguous group (e.g. slots 3..66)
silently maps to page 0 and moves another request's indexer keys. We reject
such groups before the page ids reach the copy kernels (BEFORE hook).

Seed item 000#3: "Add validate_page_aligned_token_indices utility and apply it
across HiCache write/load paths, NSA indexer transfers, and CUDA direct copy
kernels to reject malformed (partial, misaligned, non-contiguous) page groups
before they reach native transfer code."

Gate: SGLANG_CP_VALIDATE_PAGE_GROUPS (default ``host``: the CPU-side host
indices are checked, no device sync; ``all`` also checks device indices; ``0``
off). A pure bug fix for well-formed callers: they pass unchanged.
"""

from __future__ import annotations

from sglang_cp.compute import page_groups
from sglang_cp.integration.hookspec import HookSpec


def validate_indexer_page_groups(self, host_indices, device_indices, *args, **kwargs):
    mode = page_groups.validation_mode()
    if mode == "0" or host_indices is None or host_indices.numel() == 0:
        return None
    page_groups.check(host_indices, self.page_size, name="host_indices", mode=mode)
    page_groups.check(device_indices, self.page_size, name="device_indices", mode=mode)
    return None


HOOKS = (
    HookSpec(
        target="sglang.srt.mem_cache.pool_host.dsa.DSAIndexerPoolHost._get_indexer_page_indices",
        kind="before",
        fn=validate_indexer_page_groups,
        seed="000#3 validate_page_aligned_token_indices on NSA indexer transfers",
        why="the one place indexer transfers derive page ids from token indices (first index per group)",
    ),
)
