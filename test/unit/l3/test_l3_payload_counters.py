"""Per-payload counters: with sidecar payloads (the DSA indexer-K beside the target KV) a damaged page
must be attributed to the payload whose blob failed, and spills / reloads are counted per payload, so
an operator can tell which half of a page went bad and that no payload was served without the other."""

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from l3_helpers import flip, page, slab_path, slot_offset
from sglang_cp.metrics import CpL3MetricsCollector

SIZES = {"kv": 16384, "indexer": 4096}
KEYS = [b"p%d" % i for i in range(6)]


def _write_both(s):
    for p, size in SIZES.items():
        assert all(s.write_pages(p, KEYS, [page(i, size) for i in range(len(KEYS))]))


def _read(s, payload):
    return s.read_pages(payload, KEYS, [np.zeros(SIZES[payload], np.uint8) for _ in KEYS])


def test_a_crc_error_names_its_payload_and_spills_reloads_count_per_payload(make_store):
    s = make_store(payloads=dict(SIZES))
    _write_both(s)
    flip(slab_path(s, "indexer"), slot_offset(s, KEYS[2], "indexer") + 100)
    assert _read(s, "kv") == [True] * 6
    assert _read(s, "indexer") == [i != 2 for i in range(6)]
    st = s.stats()
    pc = st["payload_counters"]
    assert pc["indexer"]["crc_errors"] == 1 and pc["kv"]["crc_errors"] == 0
    assert st["counters"]["crc_errors"] == 1
    assert pc["kv"]["spill_pages"] == 6 and pc["indexer"]["spill_pages"] == 6
    assert pc["kv"]["reload_hits"] == 6 and pc["indexer"]["reload_hits"] == 5
    assert st["counters"]["reload_hits"] == 11

    reg = CollectorRegistry()
    col = CpL3MetricsCollector({"cp_rank": "0", "tp_rank": "0", "pp_rank": "0"}, registry=reg)
    col.update(st)
    col.update(s.stats())  # a second snapshot must not double-count
    text = generate_latest(reg).decode()
    lab = 'cp_rank="0",payload="{}",pp_rank="0",tp_rank="0"'.format
    assert f"sglang:cp_l3_payload_crc_errors_total{{{lab('indexer')}}} 1.0" in text
    assert f"sglang:cp_l3_payload_crc_errors_total{{{lab('kv')}}} 0.0" in text
    assert f"sglang:cp_l3_payload_reload_pages_total{{{lab('indexer')}}} 5.0" in text
    assert f"sglang:cp_l3_payload_reload_pages_total{{{lab('kv')}}} 6.0" in text
    assert f"sglang:cp_l3_payload_spill_pages_total{{{lab('kv')}}} 6.0" in text
