"""Hook point: ``get_page_buffer_meta`` of the MLA and DSA-indexer host pools
(``sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost.get_page_buffer_meta``,
``sglang.srt.mem_cache.pool_host.dsa.DSAIndexerPoolHost.get_page_buffer_meta``).

Why: zero-copy storage I/O (batch_get_v1/batch_set_v1 of every HiCache storage
backend, and the per-page blob gather of an L3 store) takes one pointer per page
from here, computed from ``indices[i]`` at each ``page_size`` stride. Upstream
asserts only the length, so a misaligned or non-contiguous group yields the
pointer of a different page and the backend reads or writes the wrong bytes.
We validate the group before any pointer is formed (BEFORE hook).

Seed item 000#3 (HiCache write/load paths): reject partial, misaligned or
non-contiguous page groups before native transfer code.

Gate: SGLANG_CP_VALIDATE_PAGE_GROUPS (see seed_dsa_indexer_page_groups); these
indices are host-pool slots on the CPU, so the default ``host`` mode checks them.
"""

from __future__ import annotations

from sglang_cp.compute import page_groups
from sglang_cp.integration.hookspec import HookSpec


def _page_size_of(pool) -> int:
    # MLA pools with DCP address logical pages; the others have one page size.
    return getattr(pool, "logical_page_size", None) or pool.page_size


def validate_page_buffer_indices(self, indices, *args, **kwargs):
    mode = page_groups.validation_mode()
    if mode == "0" or indices is None or len(indices) == 0:
        return None
    page_groups.check(indices, _page_size_of(self), name="indices", mode=mode)
    return None


HOOKS = (
    HookSpec(
        target="sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost.get_page_buffer_meta",
        kind="before",
        fn=validate_page_buffer_indices,
        seed="000#3 validate_page_aligned_token_indices on HiCache write/load paths",
        why="zero-copy storage takes one pointer per page from indices[::page_size] here",
    ),
    HookSpec(
        target="sglang.srt.mem_cache.pool_host.dsa.DSAIndexerPoolHost.get_page_buffer_meta",
        kind="before",
        fn=validate_page_buffer_indices,
        seed="000#3 validate_page_aligned_token_indices on NSA indexer transfers",
        why="zero-copy storage of the indexer sidecar takes one pointer per page here",
    ),
)
