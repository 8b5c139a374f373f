"""Offline occupancy of an L3 directory (``sglang-cp l3 stats``): slab files + the LMDB index.

Per slab (rank, disk, payload): slots, slots the index references, bytes, GC state against the
configured watermarks, and the age of the coldest/newest page. Read-only: it opens the index
and lists the slab directory; it reads no slot.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

from ..config import L3Config
from .fsck import all_entries, find_slabs, open_index
from ..recovery import read_records


GC_STATES = {
    "reclaiming": "above gc.high_watermark: GC reclaims the coldest pages toward gc.low_watermark",
    "between": "between the watermarks: no GC until above gc.high_watermark",
    "idle": "below gc.low_watermark",
}


def gc_state(frac: float, high: float, low: float) -> str:
    if frac > high:
        return "reclaiming"
    if frac > low:
        return "between"
    return "idle"


def collect(config: L3Config) -> dict:
    slabs = find_slabs(config)
    index = open_index(config)
    entries = all_entries(index) if index is not None else []
    index_info = None
    if index is not None:
        info, st = index.env.info(), index.env.stat()
        index_info = {"dir": config.index_dir, "entries": len(entries), "map_size": info["map_size"],
                      "used_bytes": (info["last_pgno"] + 1) * st["psize"],
                      "max_map_size": config.index.max_map_size_bytes, "readers": info["num_readers"]}
        index.close()
    by_slab = defaultdict(list)
    for _, e in entries:
        by_slab[(e.disk, e.rank, e.payload_tag)].append(e)
    now_ns = time.time_ns()
    rows, matched = [], 0
    for s in slabs:
        es = [e for e in by_slab.get((s.disk, s.rank, s.tag), []) if 0 <= e.slot < s.num_slots]
        matched += len(es)
        frac = len(es) / s.num_slots if s.num_slots else 0.0
        ages = [max(0, now_ns - e.last_access) / 1e9 for e in es]
        rows.append({
            "rank": s.rank, "disk": config.disks[s.disk].name, "payload": s.payload, "path": s.path,
            "slot_bytes": s.slot_bytes, "slots": s.num_slots, "used": len(es), "fraction": frac,
            "file_bytes": os.path.getsize(s.path), "payload_bytes": sum(e.length for e in es),
            "coldest_age_s": max(ages) if ages else None, "newest_age_s": min(ages) if ages else None,
            "gc": gc_state(frac, config.gc.high_watermark, config.gc.low_watermark),
        })
    return {
        "config": config.source, "slabs": rows, "index": index_info,
        "unmatched_entries": len(entries) - matched,
        "gc_states": GC_STATES,
        "gc": {"high_watermark": config.gc.high_watermark, "low_watermark": config.gc.low_watermark,
               "max_reclaim_per_iter": config.gc.max_reclaim_per_iter},
        "last_cold_start": cold_start_records(config),
    }


def cold_start_records(config: L3Config) -> list[dict]:
    """Each rank's last cold start, as the store recorded it next to its slabs (one per rank+disk)."""
    out = []
    for disk in config.disks:
        sub = config.slab_dir(disk.path)
        if not os.path.isdir(sub):
            continue
        out.extend(dict(rec, disk=disk.name) for rec in read_records(sub))
    return sorted(out, key=lambda r: (r.get("rank", -1), r["disk"]))
