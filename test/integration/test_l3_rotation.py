"""Prefetched spans continue their radix chain's rotation (KV sharding)."""

import textwrap

from suite_helpers import run_py
from benchmark.support.cp_harness import PAGE, run_ranks
from cp_scenarios import forced_phase_probe
from sglang_cp.cli import write_demo_config
from sglang_cp.integration.cp_l3.plan import continuation_phase, rotation_base


def test_phase_arithmetic():
    # anchor starting at owner 3 and 6 pages long on N=4: the next page is owned by (3+6)%4 = 1
    assert continuation_phase(3, 6, 4) == 1
    assert continuation_phase(None, 6, 4) is None
    # stamping inverts it: a node starting at page 6 with first owner 1 has base 3
    assert rotation_base(1, 6, 4) == 3


def test_anchor_phase_decides_what_is_reloaded(disk_tmp):
    cfg = write_demo_config(str(disk_tmp / "l3"), capacity_gb=0.05)
    same = run_ranks(2, forced_phase_probe, (cfg, 5, 1, 1))
    for r in same:
        assert r["hit"] == 5 * PAGE and r["owners"] == [1, 0, 1, 0, 1] and r["equal"] == r["checked"]
    # An anchor whose rotation puts page 0 on the rank that never wrote it: a miss, and
    # nothing is loaded into the other rank's slots.
    other = run_ranks(2, forced_phase_probe, (cfg, 5, 1, 0))
    assert [r["hit"] for r in other] == [0, 0] and [r["owners"] for r in other] == [[], []]


STAMP = textwrap.dedent(
    """
    import os, torch
    os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import get_context
    from sglang_cp.integration.cp_l3.plan import RESTORE
    PS = 4
    with get_context().override_server_args():
        alloc = PageInterleavePoolAllocator(size=PS * 32, physical_page_size=PS, shard_size=2,
                                            dtype=torch.int64, device="cpu", kvcache=None, need_sort=False)
        cache = UnifiedRadixCache(CacheInitParams(
            disable=False, req_to_token_pool=ReqToTokenPool(8, 4096, "cpu", False),
            token_to_kv_pool_allocator=alloc, page_size=PS, tree_components=(ComponentType.FULL,)))
        tc = cache.tree_core
        root = tc.root_node.id
        plain = tc.insert_host(root, RadixKey(list(range(100, 100 + 2 * PS))), torch.arange(2 * PS), ["p", "q"])
        print("PLAIN", tc.node_by_id(plain.inserted_host_node).rotation_base)
        RESTORE.shard_size = 2  # what our backend's attach under 2-way sharding sets
        # A prefetched bounce whose first page (position 0, root anchor) is owned by rank 1:
        # logical host pages 1, 2, 3 (owner of page h is h % 2).
        host = torch.arange(PS, 4 * PS)
        res = tc.insert_host(root, RadixKey(list(range(3 * PS))), host, ["a", "b", "c"])
        node = tc.node_by_id(res.inserted_host_node)
        print("STAMPED", node.rotation_base, tc.rotation_phase_of(node.id))
        # The anchor's phase fixes the next prefetch: after a 3-page chain at phase 1 the
        # next page belongs to (1 + 3) % 2 = 0.
        tc.prefetch_anchor_info(node.id)
        print("FORCED", RESTORE.anchors.take(tc.get_last_hash_value(node.id)))
        # A span whose owners contradict the anchor's rotation is dropped (a miss): pages 101, 102
        # start at owner 1 at position 3, base (1 - 3) % 2 = 0, while the anchor's base is 1.
        host2 = torch.arange(101 * PS, 103 * PS)
        res2 = tc.insert_host(node.id, RadixKey(list(range(3 * PS, 5 * PS))), host2, ["d", "e"])
        print("DROPPED", res2.host_insert_dropped, res2.inserted_host_node)
        # A chain a request computed under base 0 while a root-anchored prefetch was in flight (pages 200,
        # 201: owners 0, 1 from position 0). The prefetch agreed on base 1 (pages 301.., owners 1, 0, 1, 0)
        # for a longer span of the same tokens: upstream's walk would fill the chain's host copy with owners
        # of the other base and hang the rest under it, a mixed chain. It is dropped.
        keys = list(range(500, 500 + 4 * PS))
        chain = tc.insert_host(root, RadixKey(keys[: 2 * PS]), torch.arange(200 * PS, 202 * PS), ["w", "x"])
        print("CHAIN", tc.node_by_id(chain.inserted_host_node).rotation_base)
        res3 = tc.insert_host(root, RadixKey(keys), torch.arange(301 * PS, 305 * PS), ["w", "x", "y", "z"])
        print("GRAFT", res3.host_insert_dropped, res3.inserted_host_node)
        # The same span under the chain's own base is inserted below it.
        res4 = tc.insert_host(root, RadixKey(keys), torch.arange(200 * PS, 204 * PS), ["w", "x", "y", "z"])
        tail = tc.node_by_id(res4.inserted_host_node)
        print("EXTENDED", res4.host_insert_dropped, tail.rotation_base, tail.parent.rotation_base)
    """
)


def test_prefetched_nodes_get_the_agreed_rotation_base():
    p = run_py(STAMP, check=True)
    assert "PLAIN None" in p.stdout          # upstream's behaviour without our stamp
    assert "STAMPED 1 1" in p.stdout         # real UnifiedTreeCore.insert_host, stamped
    assert "FORCED 0" in p.stdout
    assert "DROPPED True None" in p.stdout
    assert "CHAIN 0" in p.stdout
    assert "GRAFT True None" in p.stdout     # a span of another base than the chain below a root anchor
    assert "EXTENDED False 0 0" in p.stdout
