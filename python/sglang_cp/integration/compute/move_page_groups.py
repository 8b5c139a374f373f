"""Hook point: ``sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController.move_hybrid_indices``.

Why: every HiCache load and backup of the hybrid controller (the one every
HiCache deployment builds, CP-sharded DSA included) passes its host indices
through here, and here they are still the logical host slots on the CPU. Under
kernel I/O (which ``arg_groups/kv_shard_hook.py`` requires for CP-sharded DSA)
``HiCacheController.move_indices``, called from here, moves them to the GPU
before the DSA indexer transfer derives page ids from the first index of each
group (``DSAIndexerPoolHost._get_indexer_page_indices``). Past the move a check
costs a device sync, so the default ``host`` mode of the indexer hook skips it:
a torn group such as ``[1,2,3,4, 9,8,7,6]`` moved another request's indexer
keys without error. We validate before the move (BEFORE hook), on the CPU, at
no added device sync.

What is checked: the operation's host indices when the anchor host pool is a
page-grouped pool (MLA, or MLA behind ``PageInterleaveHostPool``; DSA indexer),
and the host indices of each pool transfer whose host pool is one of those. The
indices are the logical slots before ``owned_rows`` narrows them to a CP rank, so
every rank reaches the same verdict (a rank-local verdict would let one rank
raise while its peers wait in the next collective). Page size: the pool's
``logical_page_size`` (the widened DCP page; the physical page without DCP).
Mamba/SWA side pools are not page-grouped and are left alone. Device indices
are GPU tensors here; ``SGLANG_CP_VALIDATE_PAGE_GROUPS=all`` checks them too
(one sync per transfer).

Seed item 000#3: "apply [validate_page_aligned_token_indices] across HiCache
write/load paths, NSA indexer transfers, and CUDA direct copy kernels".

Gate: ``SGLANG_CP_VALIDATE_PAGE_GROUPS`` (default ``host``; ``0`` = upstream).
"""

from __future__ import annotations

from sglang_cp.compute import page_groups
from sglang_cp.integration.hookspec import HookSpec


def native_pool(pool):
    """The concrete host pool behind a ``PageInterleaveHostPool`` facade."""
    from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

    if isinstance(pool, PageInterleaveHostPool):
        return object.__getattribute__(pool, "host_pool")
    return pool


def page_grouped(pool) -> bool:
    """Pools whose transfers read one index per page (indexer page ids, direct
    copies with ``page_size``, zero-copy page pointers)."""
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    return isinstance(native_pool(pool), (MLATokenToKVPoolHost, DSAIndexerPoolHost))


def logical_page_size(pool) -> int:
    return getattr(pool, "logical_page_size", None) or pool.page_size


def validate_before_move(self, operation, *args, **kwargs):
    mode = page_groups.validation_mode()
    if mode == "0":
        return None
    group = self.mem_pool_host
    anchor_entry = getattr(group, "anchor_entry", None)
    if anchor_entry is None:  # not a HostPoolGroup: nothing this hook knows how to read
        return None
    anchor = anchor_entry.host_pool
    if page_grouped(anchor):
        ps = logical_page_size(anchor)
        page_groups.check(operation.host_indices, ps, name="host_indices", mode=mode)
        page_groups.check(operation.device_indices, ps, name="device_indices", mode=mode)
    for transfer in operation.pool_transfers or ():
        entry = group.entry_map.get(transfer.name)
        if entry is None or not page_grouped(entry.host_pool):
            continue
        ps = logical_page_size(entry.host_pool)
        label = getattr(transfer.name, "value", transfer.name)
        page_groups.check(
            transfer.host_indices, ps, name=f"{label} host_indices", mode=mode
        )
        page_groups.check(
            transfer.device_indices, ps, name=f"{label} device_indices", mode=mode
        )
    return None


HOOKS = (
    HookSpec(
        target="sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController.move_hybrid_indices",
        kind="before",
        fn=validate_before_move,
        seed="000#3 validate_page_aligned_token_indices on HiCache write/load paths and NSA indexer transfers",
        why="the last point where the logical host indices are on the CPU before kernel I/O moves them to the GPU",
    ),
)
