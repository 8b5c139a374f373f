"""Upstream's prefetch outcomes reach /metrics through our backend: upstream attaches its snapshot to the
StorageMetrics our get_stats() returned (a contract of the installed sglang, pinned here), our collector
publishes it as sglang:cp_l3_prefetch_outcomes_total{outcome} counters."""

import inspect

from sglang_cp.integration.cp_l3.prefetch_outcomes import PrefetchOutcomes


def test_upstream_attaches_its_outcome_snapshot_to_the_backends_storage_metrics():
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    src = inspect.getsource(UnifiedRadixCache)
    assert "storage_metrics = self.cache_controller.storage_backend.get_stats()" in src
    assert 'if not hasattr(storage_metrics, "prefetch_stats"):' in src
    assert "storage_metrics.prefetch_stats = self.prefetch_outcome_stats_snapshot()" in src
    for key in ("declined_too_short", "declined_rate_limited", "declined_anchor_lost", "revoked_insufficient",
                "revoked_full_miss"):
        assert f'"{key}"' in src, key  # the outcome keys bench_peers tables


def test_the_snapshot_upstream_attaches_is_what_latest_reports():
    from sglang.srt.observability.metrics_collector import StorageMetrics

    outcomes = PrefetchOutcomes()
    assert outcomes.latest() is None
    handed = outcomes.for_upstream()
    assert type(handed) is StorageMetrics and handed.prefetch_pgs == []  # what upstream makes for None
    assert outcomes.latest() is None  # not attached yet
    handed.prefetch_stats = {"attempts": 3, "declined_rate_limited": 1, "l3_miss_tokens": 640.0, "note": "x"}
    assert outcomes.latest() == {"attempts": 3.0, "declined_rate_limited": 1.0, "l3_miss_tokens": 640.0}
    outcomes.for_upstream()  # the next flush: read before upstream attaches to it
    assert outcomes.latest()["declined_rate_limited"] == 1.0  # the last snapshot seen stands


def test_the_collector_publishes_outcomes_as_monotonic_counters():
    from prometheus_client import CollectorRegistry

    from sglang_cp.metrics import CpL3MetricsCollector

    reg = CollectorRegistry()
    c = CpL3MetricsCollector({"cp_rank": "1", "tp_rank": "0", "pp_rank": "0"}, registry=reg)

    def value(outcome):
        return reg.get_sample_value("sglang:cp_l3_prefetch_outcomes_total",
                                    {"cp_rank": "1", "tp_rank": "0", "pp_rank": "0", "outcome": outcome})

    c.update({"prefetch_outcomes": {"issued": 4.0, "declined_rate_limited": 0.0}})
    assert value("issued") == 4 and value("declined_rate_limited") == 0  # zeros exported at first sight
    c.update({"prefetch_outcomes": {"issued": 6.0, "declined_rate_limited": 2.0}})
    assert value("issued") == 6 and value("declined_rate_limited") == 2
    c.update({})  # no snapshot this time: nothing moves
    assert value("issued") == 6
