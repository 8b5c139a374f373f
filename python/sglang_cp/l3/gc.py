"""Page-level LRU and the watermark policy of L3 GC (runs on the store's write thread only).

Per payload pool: above `high` occupancy GC starts and keeps reclaiming the coldest pages, at most
`budget` per write-thread iteration, until occupancy is at or below `low` (hysteresis, so the write
path never meets a full pool in steady state and GC never flaps around one watermark).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from .index import IndexEntry, ikey_digest


class PageLRU:
    """index key -> IndexEntry, coldest first. Stamps come from last_access (ns).
    Beside it, the set of the held keys' digests (one pool = one rank and payload, so a digest names
    one key): `holds` is that set's C membership test, which the hit query maps over digests without
    building index keys. The set follows the dict (added after, removed after)."""

    def __init__(self):
        self._od: OrderedDict[bytes, IndexEntry] = OrderedDict()
        self._digests: set[bytes] = set()
        self.holds = self._digests.__contains__

    def __len__(self) -> int:
        return len(self._od)

    def __contains__(self, ikey: bytes) -> bool:
        return ikey in self._od

    def get(self, ikey: bytes) -> Optional[IndexEntry]:
        return self._od.get(ikey)

    def add(self, ikey: bytes, entry: IndexEntry) -> None:
        self._od[ikey] = entry
        self._od.move_to_end(ikey)
        self._digests.add(ikey_digest(ikey))

    def seed(self, items: list[tuple[bytes, IndexEntry]]) -> None:
        """Bulk load at recovery, ordered by the durable last_access."""
        self._od.clear()
        self._digests.clear()
        for k, e in sorted(items, key=lambda kv: kv[1].last_access):
            self._od[k] = e
        self._digests.update(map(ikey_digest, self._od))

    def touch(self, ikey: bytes, stamp: int) -> Optional[IndexEntry]:
        e = self._od.get(ikey)
        if e is None:
            return None
        e = e._replace(last_access=max(stamp, e.last_access))
        self._od[ikey] = e
        self._od.move_to_end(ikey)
        return e

    def remove(self, ikey: bytes) -> Optional[IndexEntry]:
        e = self._od.pop(ikey, None)
        if e is not None:
            self._digests.discard(ikey_digest(ikey))
        return e

    def coldest(self, n: int) -> list[tuple[bytes, IndexEntry]]:
        out = []
        for k, e in self._od.items():
            if len(out) >= n:
                break
            out.append((k, e))
        return out

    def clear(self) -> None:
        self._od.clear()
        self._digests.clear()


class WatermarkPolicy:
    def __init__(self, high: float, low: float, budget: int):
        self.high, self.low, self.budget = high, low, budget
        self.active = False

    def to_reclaim(self, used: int, total: int) -> int:
        """Pages to reclaim this iteration (0 when no GC is due)."""
        if used > self.high * total:
            self.active = True
        target = int(self.low * total)
        if not self.active or used <= target:
            self.active = False
            return 0
        return min(used - target, self.budget)
