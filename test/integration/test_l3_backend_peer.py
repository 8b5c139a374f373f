"""Upstream's storage-backend checks, asked of our backend (issue 27, item 6).

Upstream SGLang tests each HiCache storage backend at its API (``storage/umbp/test_umbp_store.py``,
``storage/mooncake_store/test_mooncake_store.py``, ``HiCacheFile.batch_exists_v2`` and its hit policies
in ``hicache_storage.py``): a page round-trips byte for byte, ``batch_exists`` is the length of the
leading run of stored keys, a second set of a stored key keeps the first bytes, ``clear`` empties,
keys of different TP ranks never meet, and a multi-pool ``batch_exists_v2`` answers the pages every
pool holds. The same questions here, written for this backend; only the construction differs: the
backend is built by upstream's own ``HybridCacheController`` through ``StorageBackendFactory`` with
``--enable-cp-l3`` (cp_harness ``Rank``), on two real gloo rank processes (TP = attention CP = 2,
GLM-5 MLA rows, the DSA indexer and draft KV as sidecar pools).

Where this backend differs by design, the test says so and asserts our behaviour:
- MLA pages: upstream shares one copy across TP ranks (only TP rank 0 writes,
  ``HiCacheStorageConfig.is_storage_writer``); here every rank writes and reads its own replica, its
  rank mixed into every key digest (``integration/cp_l3/keys.py``), so no rank ever reads another's bytes.
- ``batch_get_v1`` after a miss: ``HiCacheFile`` answers per key; ours stops at the first miss (a page
  after a gap is never loaded: the prefix it extends is not there).
- ``batch_exists_v2``'s ``extra_pool_hit_pages``: ``HiCacheFile`` reports each pool's own boundary; ours
  reports the agreed prefix for every pool (``kv_hit_pages`` is the same: the minimum).
- ``TRAILING_PAGES`` pools (SWA, Mamba state) are not stored: such a query is a miss and counted (a model
  with such pools is refused at attach); the legacy ``get``/``set`` API is refused
  (``test_l3_legacy_api.py``).
One rank-process pair runs every scenario (module fixture); each test asserts one property of it.
"""

import pytest

from benchmark.support.cp_harness import PAGE, run_ranks
from sglang_cp.cli import write_demo_config


def peer_checks(rank, world, rendezvous, l3_config):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    from benchmark.support.cp_harness import Rank

    r = Rank(rank, world, rendezvous, l3_config, sharded=False, sidecars=True, cold_start="clear")
    b, out = r.backend, {"rank": rank, "backend_class": type(r.backend).__name__}

    def keys(tag, n):
        return [f"{tag}-{i:02d}" for i in range(n)]  # page hashes as upstream passes them (str)

    def host(n, salt):
        hi = r.alloc_host(n * PAGE)
        r.fill(hi, n, salt)
        return hi

    def sidecar(name, ks, hi):
        return PoolTransfer(name=name, keys=ks, host_indices=hi, hit_policy=PoolHitPolicy.ALL_PAGES)

    try:
        # Round trip (umbp test_basic_set_get / test_batch_set_get_multiple_pages), every payload.
        ks, hi = keys("rt", 4), host(4, salt=11 + rank)
        out["set"] = b.batch_set_v1(ks, hi)
        out["set_v2"] = b.batch_set_v2([sidecar(PoolName.INDEXER, ks, hi), sidecar(PoolName.DRAFT, ks, hi)])
        r.zero_host()
        out["get"] = b.batch_get_v1(ks, hi)
        out["get_v2"] = b.batch_get_v2([sidecar(PoolName.INDEXER, ks, hi), sidecar(PoolName.DRAFT, ks, hi)])
        out["rt_checked"], out["rt_equal"] = r.check(hi, 4, salt=11 + rank)

        # Content addressing (umbp test_dedup_on_set): a second set of a stored key keeps the first bytes.
        r.fill(hi, 4, salt=99)
        out["reset"] = b.batch_set_v1(ks, hi)
        out["reset_v2"] = b.batch_set_v2([sidecar(PoolName.INDEXER, ks, hi), sidecar(PoolName.DRAFT, ks, hi)])
        r.zero_host()
        b.batch_get_v1(ks, hi)
        b.batch_get_v2([sidecar(PoolName.INDEXER, ks, hi), sidecar(PoolName.DRAFT, ks, hi)])
        out["dedup_checked"], out["dedup_equal"] = r.check(hi, 4, salt=11 + rank)

        # Leading run (umbp test_batch_exists) and a partial prefix with a gap: pages 0, 1 and 3 stored.
        ps = keys("gap", 4)
        hg = host(4, salt=5)
        b.batch_set_v1([ps[0], ps[1], ps[3]], r.torch.cat([hg[:2 * PAGE], hg[3 * PAGE:]]))
        out["exists_run"] = b.batch_exists(ps[:2] + ["never-written"])
        out["exists_gap"] = b.batch_exists(ps)
        out["exists_after_gap"] = b.batch_exists(ps[3:])
        out["get_gap"] = b.batch_get_v1(ps, hg)
        out["exists_empty"] = b.batch_exists([])

        # Multi-pool minimum: KV for 4 pages, the indexer for 2, draft KV for 3 -> 2 logical pages.
        ms, hm = keys("multi", 4), host(4, salt=7)
        b.batch_set_v1(ms, hm)
        b.batch_set_v2([sidecar(PoolName.INDEXER, ms[:2], hm[:2 * PAGE]), sidecar(PoolName.DRAFT, ms[:3], hm[:3 * PAGE])])
        res = b.batch_exists_v2(ms, [sidecar(PoolName.INDEXER, ms, hm), sidecar(PoolName.DRAFT, ms, hm)])
        out["v2_multi"] = (res.kv_hit_pages, dict(res.extra_pool_hit_pages))
        out["v2_kv_only"] = b.batch_exists_v2(ms).kv_hit_pages
        res = b.batch_exists_v2(ms, [sidecar(PoolName.DRAFT, ms, hm)])
        out["v2_draft"] = res.kv_hit_pages
        before = b.unsupported_queries
        trailing = PoolTransfer(name=PoolName.DRAFT, keys=ms, host_indices=hm,
                                hit_policy=PoolHitPolicy.TRAILING_PAGES)
        out["v2_trailing"] = b.batch_exists_v2(ms, [trailing]).kv_hit_pages
        out["v2_trailing_counted"] = b.unsupported_queries - before
        out["v2_empty"] = b.batch_exists_v2([]).kv_hit_pages

        # Key isolation across TP ranks (mooncake test_batch_operation with tp_rank 0/1): both ranks
        # write the same page hashes with their own bytes, and rank 0 one more that rank 1 never writes.
        ts, ht = keys("tp", 3), host(3, salt=1000 + rank)
        b.batch_set_v1(ts, ht)
        b.batch_set_v2([sidecar(PoolName.INDEXER, ts, ht), sidecar(PoolName.DRAFT, ts, ht)])
        if rank == 0:
            b.batch_set_v1(["only-rank0"], host(1, salt=3))
        r.dist.barrier()
        r.zero_host()
        out["tp_get"] = b.batch_get_v1(ts, ht)
        b.batch_get_v2([sidecar(PoolName.INDEXER, ts, ht), sidecar(PoolName.DRAFT, ts, ht)])
        out["tp_checked"], out["tp_equal"] = r.check(ht, 3, salt=1000 + rank)
        out["tp_other_rank_key"] = b.batch_exists(["only-rank0"])

        # clear (umbp test_clear): this rank's pages are gone, the other rank's are its own business.
        r.dist.barrier()
        if rank == 1:
            b.clear()
        r.dist.barrier()
        out["after_clear"] = b.batch_exists(ks)

        # upstream's prefetch outcomes: the StorageMetrics get_stats() hands upstream carries them back
        handed = b.get_stats()
        out["stats_type"] = type(handed).__name__
        out["outcomes_before"] = "prefetch_outcomes" in b.l3_stats()
        handed.prefetch_stats = {"issued": 2, "declined_rate_limited": 1}  # as upstream's flush attaches it
        out["outcomes_after"] = b.l3_stats().get("prefetch_outcomes")
        return out
    finally:
        r.close()


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    root = tmp_path_factory.mktemp("peer")
    cfg = write_demo_config(str(root / "l3"), capacity_gb=0.05)
    return run_ranks(2, peer_checks, (cfg,), timeout=300)


def test_backend_is_ours_built_by_upstreams_factory(peers):
    assert {p["backend_class"] for p in peers} == {"CpL3Storage"}


def test_get_stats_carries_upstreams_prefetch_outcomes_into_our_stats(peers):
    for p in peers:
        assert p["stats_type"] == "StorageMetrics" and p["outcomes_before"] is False, p
        assert p["outcomes_after"] == {"issued": 2.0, "declined_rate_limited": 1.0}, p


def test_pages_round_trip_in_every_payload(peers):
    for p in peers:
        assert p["set"] == [True] * 4 and p["get"] == [True] * 4, p
        assert p["set_v2"] == {"indexer": [True] * 4, "draft": [True] * 4}, p
        assert p["get_v2"] == {"indexer": [True] * 4, "draft": [True] * 4}, p
        assert p["rt_equal"] == p["rt_checked"] == 4, p  # KV, indexer and draft bytes all equal


def test_a_second_set_of_a_stored_key_keeps_the_first_bytes(peers):
    for p in peers:
        assert p["reset"] == [True] * 4, p  # acknowledged: the key is stored
        assert p["reset_v2"] == {"indexer": [True] * 4, "draft": [True] * 4}, p
        assert p["dedup_equal"] == p["dedup_checked"] == 4, p


def test_exists_is_the_leading_run_and_a_gap_ends_the_prefix(peers):
    for p in peers:
        assert p["exists_run"] == 2, p
        assert p["exists_gap"] == 2, p  # pages 0, 1 stored, 2 missing: page 3 does not count
        assert p["exists_after_gap"] == 1, p  # page 3 itself is stored
        assert p["exists_empty"] == 0, p
        # Differs by design from HiCacheFile's per-key answer ([T, T, F, T]): nothing after the first miss.
        assert p["get_gap"] == [True, True, False, False], p


def test_multi_pool_exists_is_the_minimum_over_pools(peers):
    for p in peers:
        kv_hit, extra = p["v2_multi"]
        assert kv_hit == 2, p  # KV 4, indexer 2, draft 3
        # Differs by design: every pool reports the agreed prefix (HiCacheFile: each its own boundary).
        assert extra == {"indexer": 2, "draft": 2}, p
        assert p["v2_kv_only"] == 4 and p["v2_draft"] == 3 and p["v2_empty"] == 0, p


def test_trailing_window_pools_are_a_counted_miss(peers):
    for p in peers:
        assert p["v2_trailing"] == 0 and p["v2_trailing_counted"] == 1, p


def test_tp_ranks_never_read_each_others_pages(peers):
    """Same page hashes on both ranks, each rank's own bytes back; a key only rank 0 wrote is a miss on
    rank 1. Differs by design from upstream's MLA sharing (one copy, TP rank 0 writes): every rank keeps
    its own replica, so this holds for MLA too."""
    for p in peers:
        assert p["tp_get"] == [True] * 3 and p["tp_equal"] == p["tp_checked"] == 3, p
    assert [p["tp_other_rank_key"] for p in peers] == [1, 0], peers


def test_clear_drops_this_ranks_pages_only(peers):
    assert [p["after_clear"] for p in peers] == [4, 0], peers
