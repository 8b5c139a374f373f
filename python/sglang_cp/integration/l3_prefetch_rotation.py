"""Hook point: the radix tree core's side of an L3 prefetch under KV sharding
(``mem_cache/unified_cache/unified_tree_core.py::UnifiedTreeCore``), fed by the
controller (``HybridCacheController.prefetch``, ``.alloc_prefetch_host_buffers``).

Under ``--enable-kv-cache-sharding`` every radix chain carries a rotation base ``b``:
position-page ``P`` is owned by rank ``(b + P) % N`` (``UnifiedTreeNode.rotation_base``).
Upstream never had a storage tier under sharding, so a prefetched span enters the tree
through ``UnifiedTreeCore.insert_host`` without one. We keep chains coherent:

- ``UnifiedTreeCore.prefetch_anchor_info`` (AROUND; upstream's ``prefetch_from_storage``
  calls it for the anchor right before submitting the prefetch) + ``HybridCacheController.
  prefetch`` (AFTER, creates the operation on the same thread): when the anchor already
  has a rotation base, the prefetched pages must continue it, so the phase of the first
  prefetched page is fixed: the anchor's phase plus its length in pages. It comes from
  the replicated radix tree (identical on every rank) and the phase agreement then only
  measures how much is durable at that phase. A root anchor leaves the phase free.
- ``alloc_prefetch_host_buffers`` (see ``l3_prefetch_agreement``) records, for the
  allocated bounce, the base ``(phase - storage_start_pages) % N``;
  ``UnifiedTreeCore.insert_host`` (AROUND) stamps it on the nodes the prefetch creates,
  so ``rotation_phase_of(node)`` is the owner of each node's first page and a later
  extension continues the rotation instead of being declined. If the anchor's base
  disagrees (cannot happen with the fixed phase; a guard, not a path), the insert is
  dropped through upstream's own ``host_insert_dropped`` path: a miss, never a mixed chain.

We hook the tree core and the controller, not ``UnifiedRadixCache``: importing that
module at plugin load pulls in the reasoning-parser registry and would change the
order of upstream's ``--reasoning-parser`` choices (flags-off neutrality).

Seed items: "load that preserves the owner pattern", "reload on miss with the
partial-prefix slice" (the inserted span is exactly the agreed durable prefix).
"""

from __future__ import annotations

import collections
import threading

from sglang_cp.integration.hookspec import HookSpec

_UTC = "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore"
_HC = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController"

_tls = threading.local()
_sharded = {"shard_size": 0}  # set by the L3 backend when it attaches under sharding
_stamps: "collections.OrderedDict[int, int]" = collections.OrderedDict()
_stamps_lock = threading.Lock()
_MAX_STAMPS = 4096  # allocations whose insert never came (misses) age out


def set_shard_size(n: int) -> None:
    _sharded["shard_size"] = n


def forced_phase(anchor_phase, anchor_pages: int, shard_size: int):
    """Owner of the first page after the anchor, or None for a root anchor."""
    if anchor_phase is None:
        return None
    return (anchor_phase + anchor_pages) % shard_size


def stamp_base(start_owner: int, storage_start_tokens: int, page_size: int, shard_size: int) -> int:
    return (start_owner - storage_start_tokens // page_size) % shard_size


def prefetch_anchor_info_around(original, self, node_id):
    n = _sharded["shard_size"]
    if n:
        node = self.node_by_id(node_id)
        phase = None if node is self.root_node else self.rotation_phase_of(node_id)
        pages = len(node.key) // self.page_size if node.key is not None else 0
        _tls.forced = forced_phase(phase, pages, n)
    return original(self, node_id)


def controller_prefetch_after(operation, self, *args, **kwargs):
    forced = getattr(_tls, "forced", None)
    _tls.forced = None
    if forced is not None:
        operation._cp_l3_forced_phase = forced
    return operation


def remember_stamp(host_indices, start_owner: int, storage_start_tokens: int, page_size: int,
                   shard_size: int) -> None:
    base = stamp_base(start_owner, storage_start_tokens, page_size, shard_size)
    with _stamps_lock:
        _stamps[host_indices.data_ptr()] = base
        while len(_stamps) > _MAX_STAMPS:
            _stamps.popitem(last=False)


def insert_host_around(original, self, node_id, key, host_value, hash_value):
    stamp = None
    if _sharded["shard_size"] and host_value is not None and host_value.numel():
        with _stamps_lock:
            stamp = _stamps.pop(host_value.data_ptr(), None)
    if stamp is None:
        return original(self, node_id, key, host_value, hash_value)
    anchor = self.node_by_id(node_id)
    if anchor is not self.root_node and anchor.rotation_base is not None and anchor.rotation_base != stamp:
        from sglang.srt.mem_cache.base_prefix_cache import InsertResult

        return InsertResult(prefix_len=0, total_len=len(key), host_insert_dropped=True)
    result = original(self, node_id, key, host_value, hash_value)
    if getattr(result, "inserted_host_node", None) is None:
        return result
    node = self.node_by_id(result.inserted_host_node)
    while node is not None and node is not anchor and node is not self.root_node:
        if node.rotation_base is None:
            node.rotation_base = stamp
        node = node.parent
    return result


HOOKS = (
    HookSpec(f"{_UTC}.prefetch_anchor_info", "around", prefetch_anchor_info_around,
             seed="load that preserves the owner pattern",
             why="prefetch_from_storage asks the tree core about the anchor right before submitting"),
    HookSpec(f"{_HC}.prefetch", "after", controller_prefetch_after,
             seed="load that preserves the owner pattern",
             why="where the PrefetchOperation is created, on the scheduler thread"),
    HookSpec(f"{_UTC}.insert_host", "around", insert_host_around,
             seed="reload on miss with the partial-prefix slice",
             why="creates the prefetched nodes; upstream leaves their rotation base empty"),
)
