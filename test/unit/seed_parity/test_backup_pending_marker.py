"""002#16 / 002#40, radix half: the fork's split/prune probes read rank-local,
drain-timed dicts; the fix was a replicated per-node backup-pending marker, set
at backup registration, propagated on split, cleared only at the MIN-committed
ack, with a fail-fast on double attach. Upstream 0.5.23 has exactly that marker
(``UnifiedTreeNode.write_through_pending_id``). Driven here on a real
UnifiedRadixCache with the Python UnifiedTreeCore (the core KV sharding uses).
The MIN-committed drain itself is test_rank_uniform_collectives.py.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def cache(monkeypatch):
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args():
        alloc = PagedTokenToKVPoolAllocator(256, 4, torch.int64, "cpu", None, False)
        c = UnifiedRadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=ReqToTokenPool(8, 256, "cpu", False),
                token_to_kv_pool_allocator=alloc,
                page_size=4,
                tree_components=(ComponentType.FULL,),
            )
        )
        assert type(c.tree_core).__name__ == "UnifiedTreeCore"
        yield c, alloc


def _insert(c, alloc, tokens):
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    res = c.insert(InsertParams(key=RadixKey(list(tokens)), value=alloc.alloc(len(tokens))))
    c._apply_cache_actions(res.cache_actions)
    return res


def _node(c, node_id):
    return c.tree_core.node_by_id(node_id)


def test_marker_set_at_backup_propagated_on_split_cleared_at_ack(cache):
    c, alloc = cache
    leaf = _insert(c, alloc, range(16)).last_device_node
    c._track_write_through_node(leaf, None, [leaf])  # backup registered (rank-uniform)
    assert _node(c, leaf).write_through_pending_id == leaf

    # A request sharing 8 tokens splits the pending node: both halves must stay
    # pending under the same ack, and the ack must publish both.
    _insert(c, alloc, [*range(8), 90, 91, 92, 93])
    parent = _node(c, leaf).parent
    assert parent.id != c.tree_core.root_node.id and len(parent.children) == 2
    assert parent.write_through_pending_id == leaf
    assert set(c.ongoing_write_through[leaf].publish_node_ids) == {parent.id, leaf}

    c._finish_write_through_ack(leaf)  # only the MIN-agreed writing_check calls this
    assert _node(c, leaf).write_through_pending_id is None
    assert parent.write_through_pending_id is None
    assert leaf not in c.ongoing_write_through


def test_double_attach_under_another_ack_fails_loud(cache):
    c, alloc = cache
    leaf = _insert(c, alloc, range(8)).last_device_node
    c.tree_core.mark_write_through_pending([leaf], ack_id=leaf)
    with pytest.raises(AssertionError, match="already pending under a different"):
        c.tree_core.mark_write_through_pending([leaf], ack_id=leaf + 1000)
