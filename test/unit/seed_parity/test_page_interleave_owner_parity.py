"""000#1 (owner-pattern-preserving HiCache load) and 002#19/#20 (owner-lane
eviction planner) against upstream 0.5.23's logical-page KV sharding.

The seed bug: load-back used a plain device alloc whose per-page owner pattern
was arbitrary, so each rank loaded its host bytes into slots that another rank
owns. The seed planner then had to evict per owner lane to satisfy per-owner
deficits. Upstream's page-interleave design derives ownership from the slot id
(owner = page % N), makes host slots follow the device owners at backup
(PageInterleaveHostPool.alloc(start_owner=...)), makes the device follow the host
owners at load (HybridCacheController.load -> alloc_cyclic(start_class=...)), and
refuses the plain alloc outright. These tests drive those real objects.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

PS = 4  # physical page size (tokens)


def _device_allocator(shard_size, pages_per_rank=48):
    from sglang.srt.mem_cache.allocator.page_interleave import (
        PageInterleavePoolAllocator,
    )

    return PageInterleavePoolAllocator(
        size=PS * pages_per_rank,
        physical_page_size=PS,
        shard_size=shard_size,
        dtype=torch.int64,
        device="cpu",
        kvcache=None,
        need_sort=False,
    )


def _host_pool(shard_size, shard_rank, pages_per_rank=96):
    from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec
    from sglang.srt.mem_cache.pool_host.mla import MLAHostAllocation, MLATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

    geo = MLAHostAllocation(
        dtype=torch.bfloat16,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        kv_cache_dim=576,
        size_per_token=576 * 2,
    )
    native = MLATokenToKVPoolHost(
        geo,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=PS,
        layout="page_first",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=PS * pages_per_rank,
        start_layer=0,
        end_layer=2,
        target_layer_num=2,
        host_token_capacity=PS * pages_per_rank,
    )
    spec = PageShardSpec(
        shard_rank=shard_rank,
        shard_size=shard_size,
        page_size=PS,
        max_prefix_tokens=0,
        chunk_tokens=0,
    )
    return PageInterleaveHostPool(native, PageInterleavePlacement(spec))


def _controller(device_allocator):
    """The real HybridCacheController.load, on a controller holding only what
    load() reads when no side pools ride along (allocator, device, queue)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        HybridCacheController,
    )

    ctrl = object.__new__(HybridCacheController)
    ctrl.mem_pool_device_allocator = device_allocator
    ctrl.device = "cpu"
    ctrl.load_queue = []
    return ctrl


def _page_owners(indices, shard_size):
    return (indices.view(-1, PS)[:, 0] // PS % shard_size).tolist()


def _fragment(allocator, rng, rounds):
    """Random mirrored alloc/free history: chains at random rotation bases."""
    live = []
    for _ in range(rounds):
        if live and rng.random() < 0.45:
            allocator.free(live.pop(int(rng.integers(len(live)))))
            continue
        n_pages = int(rng.integers(1, 9))
        got = allocator.alloc_cyclic(
            start_class=int(rng.integers(allocator.shard_size)), need_size=n_pages * PS
        )
        if got is not None:
            live.append(got)
    return live


def test_plain_alloc_is_refused_so_no_owner_losing_fallback_exists():
    allocator = _device_allocator(4)
    with pytest.raises(NotImplementedError):
        allocator.alloc(8 * PS)


@pytest.mark.parametrize("shard_size", [2, 4, 8])
def test_backup_then_load_keeps_every_page_with_its_owner(shard_size):
    rng = np.random.default_rng(shard_size)
    host = _host_pool(shard_size, shard_rank=shard_size - 1)
    for seed in range(60):
        device = _device_allocator(shard_size)
        host.clear()
        _fragment(device, rng, rounds=30)
        n_pages = int(rng.integers(1, 12))
        written = device.alloc_cyclic(
            start_class=int(rng.integers(shard_size)), need_size=n_pages * PS
        )
        if written is None:
            continue
        # backup: host slots follow the device page owners
        host_indices = host.alloc(
            len(written), start_owner=int(written[0]) // PS % shard_size
        )
        assert host_indices is not None
        assert _page_owners(host_indices, shard_size) == _page_owners(written, shard_size)
        device.free(written)  # evicted from L1; host copy survives
        _fragment(device, rng, rounds=10)

        ctrl = _controller(device)
        before = device.class_free_page_counts()
        loaded = ctrl.load(host_indices=host_indices)
        if loaded is None:
            # A shortage is a miss: nothing allocated, nothing queued.
            assert device.class_free_page_counts() == before and not ctrl.load_queue
            continue
        assert _page_owners(loaded, shard_size) == _page_owners(host_indices, shard_size)
        assert ctrl.load_queue[-1].device_indices is loaded


@pytest.mark.parametrize("shard_size", [2, 4, 8])
def test_min_class_admission_gate_guarantees_an_owner_preserving_load(shard_size):
    """Upstream's load-back evicts until available_size (the min-class floor)
    covers the load, then loads. If that gate holds, the owner-preserving alloc
    must succeed for ANY owner pattern: no per-owner-lane deficit can remain,
    which is the situation the seed's lane planner existed for."""
    rng = np.random.default_rng(100 + shard_size)
    checked = 0
    for _ in range(200):
        device = _device_allocator(shard_size, pages_per_rank=16)
        _fragment(device, rng, rounds=int(rng.integers(5, 40)))
        n_pages = int(rng.integers(1, 4 * shard_size))
        if device.available_size() < n_pages * PS:
            continue
        for start in range(shard_size):
            counts = device.class_free_page_counts()
            got = device.alloc_cyclic(start_class=start, need_size=n_pages * PS)
            assert got is not None, (counts, start, n_pages)
            device.free(got)
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("shard_size", [2, 4, 8])
def test_evicting_any_cached_chain_frees_every_owner_class_evenly(shard_size):
    """Within one cached chain owners are exactly cyclic, so evicting it returns
    pages to every class within one page of each other: plain LRU eviction
    toward the min-class target raises every lane, nothing to plan per lane."""
    rng = np.random.default_rng(7 * shard_size)
    for _ in range(150):
        device = _device_allocator(shard_size)
        live = _fragment(device, rng, rounds=25)
        if not live:
            continue
        victim = live[int(rng.integers(len(live)))]
        before = device.class_free_page_counts()
        device.free(victim)
        gained = [a - b for a, b in zip(device.class_free_page_counts(), before)]
        assert sum(gained) == len(victim) // PS
        assert max(gained) - min(gained) <= 1


@pytest.fixture
def python_tree_core(monkeypatch):
    # KV sharding runs on the Python UnifiedTreeCore (upstream forces it).
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")


@pytest.mark.parametrize("shard_size", [2, 4])
def test_upstream_lru_eviction_reaches_the_min_class_target(python_tree_core, shard_size):
    """The load-back path's real eviction (UnifiedRadixCache.evict_for_alloc on a
    radix tree of cyclic chains over the real sharded allocator) walks LRU until
    the MIN-class availability covers the request; after that an owner-preserving
    load of that size fits at every rotation. This is the job the seed's
    owner-lane planner did by hand."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import get_context

    rng = np.random.default_rng(shard_size)
    evicted_cases = 0
    with get_context().override_server_args():
        for _ in range(25):
            allocator = _device_allocator(shard_size, pages_per_rank=32)
            cache = UnifiedRadixCache(
                CacheInitParams(
                    disable=False,
                    req_to_token_pool=ReqToTokenPool(8, 4096, "cpu", False),
                    token_to_kv_pool_allocator=allocator,
                    page_size=PS,
                    tree_components=(ComponentType.FULL,),
                )
            )
            next_token = 0
            for _ in range(200):  # fill until a chain no longer fits
                n_pages, base = int(rng.integers(1, 8)), int(rng.integers(shard_size))
                value = allocator.alloc_cyclic(start_class=base, need_size=n_pages * PS)
                if value is None:
                    break
                key = RadixKey(list(range(next_token, next_token + n_pages * PS)))
                next_token += 100_000  # disjoint chains: every one is a leaf
                res = cache.insert(InsertParams(key=key, value=value, rotation_base=base))
                cache._apply_cache_actions(res.cache_actions)
            need_pages = int(rng.integers(1, 6 * shard_size))
            need = need_pages * PS
            if allocator.available_size() >= need:
                continue
            target = allocator.available_size() + need
            cache.evict_for_alloc(EvictParams(num_tokens=need))
            evicted_cases += 1
            if cache.full_evictable_size() > 0:  # not exhausted: target reached
                assert allocator.available_size() >= target
            if allocator.available_size() >= need:
                for start in range(shard_size):
                    got = allocator.alloc_cyclic(start_class=start, need_size=need)
                    assert got is not None
                    allocator.free(got)
    assert evicted_cases >= 20
