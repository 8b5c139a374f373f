"""L3 metrics through SGLang's own Prometheus exposition (``--enable-metrics``).

SGLang's scheduler processes create ``prometheus_client`` metrics named ``sglang:*`` and
the HTTP server exposes them (multiprocess mode across processes). We do the same from
the scheduler process that owns the L3 store, labelled by the identity that tells the
per-rank slabs apart: ``cp_rank`` / ``tp_rank`` / ``pp_rank``. Gauges use
``multiprocess_mode="mostrecent"`` like upstream's scheduler gauges.

Counters mirror the store's cumulative counters (monotonic, never reset by ``clear``):
each update adds the delta since the last one. Metrics need no rank agreement, so a
per-rank wall-clock publisher thread is fine (seed: "metrics labelled by cp_rank").
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

# store counter -> (metric suffix, help)
COUNTERS = {
    "spill_pages": ("cp_l3_spill_pages_total", "Pages made durable in L3 (data, fdatasync, index)."),
    "spill_bytes": ("cp_l3_spill_bytes_total", "Payload bytes made durable in L3."),
    "reload_hits": ("cp_l3_reload_pages_total", "Pages reloaded from L3 and verified (header + CRC)."),
    "reload_bytes": ("cp_l3_reload_bytes_total", "Payload bytes reloaded from L3."),
    "misses": ("cp_l3_read_misses_total", "Page reads that were a miss (absent, torn, CRC, I/O error)."),
    "gc_reclaimed": ("cp_l3_gc_reclaimed_total", "Pages reclaimed by L3 LRU GC."),
    "spill_replaced": ("cp_l3_spill_replaced_total",
                       "Spilled pages that replaced their own earlier index entry (a rewrite: no slot gained)."),
    "bad_pages_dropped": ("cp_l3_bad_pages_dropped_total",
                          "Pages dropped from L3 after a failed read check (their slot freed)."),
    "write_errors": ("cp_l3_write_errors_total", "L3 page writes that failed (ENOSPC, EIO, ...)."),
    "read_errors": ("cp_l3_read_errors_total", "L3 page reads that failed with an I/O error."),
    "crc_errors": ("cp_l3_crc_errors_total", "L3 pages dropped because their payload CRC did not match."),
    "header_errors": ("cp_l3_header_errors_total", "L3 pages dropped because their header did not parse."),
    "mapfull": ("cp_l3_index_mapfull_total", "LMDB MapFull events (index grown or write failed soft)."),
    "read_timeouts": ("cp_l3_read_timeouts_total", "L3 page reads not done within their bound (a miss; a stalled drive)."),
    "write_timeouts": ("cp_l3_write_timeouts_total", "L3 page writes not durable within their bound (reported not written)."),
    "clear_errors": ("cp_l3_clear_errors_total", "Runtime clears that failed in the index (the store keeps serving)."),
    "hit_queries": ("cp_l3_hit_queries_total", "L3 hit queries (one per upstream prefetch or exists call)."),
    "hit_query_keys": ("cp_l3_hit_query_keys_total", "Page keys asked about by L3 hit queries."),
    "hit_query_ns": ("cp_l3_hit_query_seconds_total",
                     "Wall seconds spent in L3 hit queries (key digests, held-table probes); divided by "
                     "cp_l3_hit_queries_total: the mean query time, which index.digest_threads lowers."),
    "read_calls": ("cp_l3_read_calls_total", "L3 page-read calls (one per upstream prefetch batch of this rank)."),
    "read_ns": ("cp_l3_read_seconds_total",
                "Wall seconds spent in L3 page-read calls (index lookup, reads, CRC checks, copy into the host "
                "pool); cp_l3_reload_bytes_total over it: the store's own restore rate."),
}
# store per-payload counter -> (metric suffix, help); labelled by ``payload`` (kv, indexer, ...)
PAYLOAD_COUNTERS = {
    "spill_pages": ("cp_l3_payload_spill_pages_total", "Pages of one payload made durable in L3."),
    "reload_hits": ("cp_l3_payload_reload_pages_total", "Pages of one payload reloaded from L3 and verified."),
    "crc_errors": ("cp_l3_payload_crc_errors_total",
                   "Pages of one payload dropped because their CRC did not match (the page is a miss)."),
}
# upstream's prefetch outcomes (integration/cp_l3/prefetch_outcomes.py), one series per upstream key
OUTCOMES = ("cp_l3_prefetch_outcomes_total",
            "Upstream's storage prefetch outcomes on this rank, by its own key: prefetches issued, declined before "
            "a lookup (too short, rate limited, anchor lost, ...), revoked after the hit query; *_tokens keys "
            "count tokens (asked of storage, missed there).")
# store counters kept in another unit than their metric's: factor to the metric's unit
SCALE = {"hit_query_ns": 1e-9, "read_ns": 1e-9}
GAUGES = {
    "used_slots": ("cp_l3_used_slots", "L3 slots in use, per payload."),
    "total_slots": ("cp_l3_total_slots", "L3 slots available, per payload."),
    "inflight_writes": ("cp_l3_inflight_writes", "L3 page writes staged but not yet durable."),
    "inflight_reads": ("cp_l3_inflight_reads", "L3 page reads in flight."),
    "queue_depth": ("cp_l3_queue_depth", "Depth of the L3 store's internal queues."),
}
PREFIX = "sglang:"


def metric_names() -> list[str]:
    return ([PREFIX + n for n, _ in COUNTERS.values()] + [PREFIX + n for n, _ in PAYLOAD_COUNTERS.values()]
            + [PREFIX + OUTCOMES[0]] + [PREFIX + n for n, _ in GAUGES.values()])


def _advance(child, last_seen: dict, key, value) -> None:
    """Move a labelled counter (``child``: created, so exported at zero, by the caller's ``labels()``) up to
    a cumulative snapshot ``value``; a snapshot below the last one seen never moves it back."""
    last = last_seen.get(key, 0)
    if value > last:
        child.inc(value - last)
    last_seen[key] = max(value, last)


class CpL3MetricsCollector:
    def __init__(self, labels: dict[str, str], registry=None):
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = registry if registry is not None else REGISTRY
        self.labels = dict(labels)
        names = list(self.labels)
        self._counters = {
            key: Counter(PREFIX + name, doc, labelnames=names, registry=registry)
            for key, (name, doc) in COUNTERS.items()
        }
        self._last = {key: 0 for key in COUNTERS}
        self._payload = {key: Counter(PREFIX + name, doc, labelnames=names + ["payload"], registry=registry)
                         for key, (name, doc) in PAYLOAD_COUNTERS.items()}
        self._payload_last: dict = {}
        self._outcomes = Counter(PREFIX + OUTCOMES[0], OUTCOMES[1], labelnames=names + ["outcome"], registry=registry)
        self._outcomes_last: dict = {}
        for metric in self._counters.values():
            metric.labels(**self.labels)  # export zeros from the start: absent != none happened

        def gauge(key, extra=()):
            name, doc = GAUGES[key]
            return Gauge(PREFIX + name, doc, labelnames=names + list(extra), registry=registry,
                         multiprocess_mode="mostrecent")

        self._used = gauge("used_slots", ("payload",))
        self._total = gauge("total_slots", ("payload",))
        self._inflight_w = gauge("inflight_writes")
        self._inflight_r = gauge("inflight_reads")
        self._queue = gauge("queue_depth", ("queue",))

    def update(self, stats: dict) -> None:
        """Publish one ``L3Store.stats()`` snapshot."""
        counters = stats.get("counters", {})
        for key, metric in self._counters.items():
            value = int(counters.get(key, 0))
            delta = value - self._last[key]
            if delta > 0:
                metric.labels(**self.labels).inc(delta * SCALE.get(key, 1))
            self._last[key] = max(value, self._last[key])
        for payload, pc in stats.get("payload_counters", {}).items():
            for key, metric in self._payload.items():
                _advance(metric.labels(**self.labels, payload=payload), self._payload_last, (payload, key),
                         int(pc.get(key, 0)))
        for outcome, value in (stats.get("prefetch_outcomes") or {}).items():
            _advance(self._outcomes.labels(**self.labels, outcome=outcome), self._outcomes_last, outcome, value)
        for payload, occ in stats.get("occupancy", {}).items():
            self._used.labels(**self.labels, payload=payload).set(occ["used"])
            self._total.labels(**self.labels, payload=payload).set(occ["total"])
        inflight = stats.get("inflight", {})
        self._inflight_w.labels(**self.labels).set(inflight.get("writes", 0))
        self._inflight_r.labels(**self.labels).set(inflight.get("reads", 0))
        for q, depth in stats.get("queues", {}).items():
            self._queue.labels(**self.labels, queue=q).set(depth)


class MetricsPublisher:
    """Publishes ``stats_fn()`` every ``interval`` seconds on a daemon thread."""

    def __init__(self, collector: CpL3MetricsCollector, stats_fn: Callable[[], Optional[dict]],
                 interval: float = 1.0):
        self.collector, self.stats_fn, self.interval = collector, stats_fn, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sglang-cp-l3-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.publish_once()

    def publish_once(self) -> None:
        stats = self.stats_fn()
        if stats is not None:
            self.collector.update(stats)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.publish_once()
