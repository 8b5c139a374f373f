"""Upstream's prefetch outcomes, published with our L3 metrics: why a prefix the storage tier might
have served was not fetched from it.

Upstream's radix cache (``mem_cache/unified_radix_cache.py::UnifiedRadixCache``) counts, per rank,
every storage prefetch it considers: issued, declined before any lookup (``declined_too_short``: under
``prefetch_threshold``; ``declined_rate_limited``: the host memory reserved for prefetches is taken;
``declined_anchor_lost``, ``declined_host_oversize``, ...), revoked after the hit query
(``revoked_insufficient``, ``revoked_full_miss``), and the tokens asked of storage and missed there
(``l1l2_miss_tokens``, ``l3_miss_tokens``). It hands a snapshot to its metrics flow by attaching it to
the ``StorageMetrics`` object its storage backend's ``get_stats()`` returned
(``storage_metrics.prefetch_stats``), and its collector then drops it: nothing reaches ``/metrics``.

Our backend's ``get_stats()`` returns a fresh upstream ``StorageMetrics`` (what upstream makes itself
when a backend returns None, so upstream's own metrics are unchanged) and this object keeps it; the
snapshot upstream attaches is read on our next publish as ``sglang:cp_l3_prefetch_outcomes_total
{outcome=...}``. No hook: upstream's documented hand-off ("exported through the log_storage_metrics
flow"), pinned by a test against the installed sglang. Seed item: "metrics labelled by cp_rank".
"""

from __future__ import annotations

from typing import Optional


class PrefetchOutcomes:
    """The latest ``StorageMetrics`` handed to upstream and the last outcome snapshot seen on one.

    ``for_upstream()`` runs on the scheduler thread (upstream's ``get_stats()`` call); ``latest()`` on
    our metrics publisher thread. Each only replaces a reference, so neither needs a lock."""

    def __init__(self):
        self._handed = None  # the StorageMetrics most recently returned to upstream
        self._seen: Optional[dict] = None  # the last snapshot upstream attached to one

    def for_upstream(self):
        from sglang.srt.observability.metrics_collector import StorageMetrics

        handed = StorageMetrics()
        self._handed = handed
        return handed

    def latest(self) -> Optional[dict]:
        """{outcome: cumulative count} from upstream's last snapshot, or None before the first one."""
        snap = getattr(self._handed, "prefetch_stats", None)
        if isinstance(snap, dict):
            self._seen = {str(k): float(v) for k, v in snap.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return self._seen
