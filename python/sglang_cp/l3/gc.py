"""Page-level LRU and the watermark policy of L3 GC (runs on the store's write thread only).

Per payload slab: above `high` occupancy GC starts and keeps reclaiming the coldest pages, at most
`budget` per write-thread iteration, until occupancy is at or below `low` (hysteresis, so the write
path never meets a full slab in steady state and GC never flaps around one watermark).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from .held import HeldDigests
from .format.index import IndexEntry, ikey_digest


class PageLRU:
    """index key -> IndexEntry, coldest first. Stamps come from last_access (ns). Changed only by the
    write thread; readers look slots up with get() (state.py: what relies on the GIL).
    It keeps its pool's bit in a HeldDigests (shared by the store's pools, see attach) in step: set
    after a key enters the dict, cleared after it leaves (one pool = one rank and payload, so a digest
    names one of its keys)."""

    def __init__(self):
        self._od: OrderedDict[bytes, IndexEntry] = OrderedDict()
        self.held, self.bit = HeldDigests(), 1

    def attach(self, held: HeldDigests, bit: int) -> None:
        """Share `held` with the other pools of the store, as `bit`; only while empty."""
        assert not self._od, "attach an LRU before it holds pages"
        self.held, self.bit = held, bit

    def holds(self, digest: bytes) -> bool:
        return bool(self.held.get(digest, 0) & self.bit)

    def __len__(self) -> int:
        return len(self._od)

    def __contains__(self, ikey: bytes) -> bool:
        return ikey in self._od

    def get(self, ikey: bytes) -> Optional[IndexEntry]:
        return self._od.get(ikey)

    def add(self, ikey: bytes, entry: IndexEntry) -> None:
        self._od[ikey] = entry
        self._od.move_to_end(ikey)
        self.held.add(ikey_digest(ikey), self.bit)

    def seed(self, items: list[tuple[bytes, IndexEntry]]) -> None:
        """Bulk load at recovery, ordered by the durable last_access. It drops the held table: the caller
        rebuilds it once every pool is seeded (HeldDigests.rebuild_table)."""
        self.clear()
        for k, e in sorted(items, key=lambda kv: kv[1].last_access):
            self._od[k] = e
            self.held.add(ikey_digest(k), self.bit)

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
            self.held.discard(ikey_digest(ikey), self.bit)
        return e

    def coldest(self, n: int) -> list[tuple[bytes, IndexEntry]]:
        out = []
        for k, e in self._od.items():
            if len(out) >= n:
                break
            out.append((k, e))
        return out

    def clear(self) -> None:
        """Forget every page. It drops the held table (cold start, the one caller, rebuilds it once after
        every pool is reset or seeded) instead of a put per discarded key."""
        keys = list(self._od)
        self._od.clear()
        self.held.drop_table()
        for k in keys:
            self.held.discard(ikey_digest(k), self.bit)


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
