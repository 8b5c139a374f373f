"""L3 metrics: names under sglang:, labelled by rank, fed from a real store's stats."""

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sglang_cp.cli import write_demo_config
from sglang_cp.l3 import L3Store, load_l3_config
from sglang_cp.metrics import CpL3MetricsCollector, MetricsPublisher, metric_names


def test_metrics_follow_a_real_store(disk_tmp):
    cfg = load_l3_config(write_demo_config(str(disk_tmp / "l3")))
    store = L3Store(cfg, rank=0, ranks_per_node=1, payloads={"kv": 8192})
    try:
        reg = CollectorRegistry()
        col = CpL3MetricsCollector({"cp_rank": "1", "tp_rank": "1", "pp_rank": "0"}, registry=reg)
        pub = MetricsPublisher(col, store.stats, interval=3600)
        pages = [np.full(8192, i, dtype=np.uint8) for i in range(5)]
        assert store.write_pages("kv", [b"k%d" % i for i in range(5)], pages) == [True] * 5
        outs = [np.zeros(8192, dtype=np.uint8) for _ in range(6)]
        assert store.read_pages("kv", [b"k%d" % i for i in range(5)] + [b"absent"], outs) == [True] * 5 + [False]
        keys = [b"k%d" % i for i in range(5)]
        assert store.exists_prefix("kv", keys + [b"absent"]) == 5
        assert store.exists_each(["kv"], keys, classes=2) == [True] * 5
        pub.publish_once()
        pub.publish_once()  # a second snapshot must not double-count
        text = generate_latest(reg).decode()
        lab = 'cp_rank="1",pp_rank="0",tp_rank="1"'
        assert f"sglang:cp_l3_hit_queries_total{{{lab}}} 2.0" in text
        assert f"sglang:cp_l3_hit_query_keys_total{{{lab}}} 11.0" in text
        # ns in the store, seconds in the metric: a few microseconds to milliseconds, never 0 or ns
        seconds = float(text.split(f"sglang:cp_l3_hit_query_seconds_total{{{lab}}} ")[1].split()[0])
        assert 0 < seconds < 1.0, seconds
        assert seconds == pytest.approx(store.stats()["counters"]["hit_query_ns"] / 1e9)
        # one read call (6 keys, one a miss), timed the same way
        assert f"sglang:cp_l3_read_calls_total{{{lab}}} 1.0" in text
        read_s = float(text.split(f"sglang:cp_l3_read_seconds_total{{{lab}}} ")[1].split()[0])
        assert 0 < read_s == pytest.approx(store.stats()["counters"]["read_ns"] / 1e9), read_s
        assert f"sglang:cp_l3_spill_pages_total{{{lab}}} 5.0" in text
        assert f"sglang:cp_l3_reload_pages_total{{{lab}}} 5.0" in text
        assert f"sglang:cp_l3_read_misses_total{{{lab}}} 1.0" in text
        assert 'sglang:cp_l3_used_slots{cp_rank="1",payload="kv",pp_rank="0",tp_rank="1"} 5.0' in text
        for name in metric_names():
            assert name in text
        pub.stop()
    finally:
        store.close()
