"""Bounded staging memory of the write path (GATHERED copies wait here until their pwrite returns)."""

from __future__ import annotations

import threading
from typing import Optional

from .aligned import aligned_buffer


class Staging:
    """Bounded staging memory: `max_inflight_pages` tokens shared by all payloads (backpressure).

    Each payload gets an arena of `limit` slot images, on transparent huge pages where the kernel
    allows, allocated and faulted in at open so the write path never pays first-touch page faults
    (slow on VMs with free-page reporting). A token comes back when its page's pwrite returned."""

    def __init__(self, limit: int, extents: set[int]):
        self._sem = threading.BoundedSemaphore(limit)
        self._free: dict[int, list[memoryview]] = {}
        self._arenas = []
        for ext in extents:
            arena = aligned_buffer(ext * limit, populate=True, huge=True)
            self._arenas.append(arena)
            mv = memoryview(arena)
            self._free[ext] = [mv[i * ext:(i + 1) * ext] for i in range(limit)]
        self._tails: dict[int, list[memoryview]] = {}
        self._lock = threading.Lock()
        self.limit = limit
        self.in_use = 0

    def acquire(self, extent: int, blocking: bool = True) -> Optional[memoryview]:
        if not self._sem.acquire(blocking):
            return None
        with self._lock:
            self.in_use += 1
            return self._free[extent].pop()

    def release(self, extent: int, buf: memoryview) -> None:
        with self._lock:
            self.in_use -= 1
            self._free[extent].append(buf)
        self._sem.release()

    def tail(self, nbytes: int) -> memoryview:
        """A small aligned block for a zero-copy write's unaligned end + header (no token: the sync
        caller that owns the page bounds these by its own batch)."""
        with self._lock:
            free = self._tails.setdefault(nbytes, [])
            if free:
                return free.pop()
        return memoryview(aligned_buffer(nbytes))

    def release_tail(self, buf: memoryview) -> None:
        with self._lock:
            self._tails.setdefault(buf.nbytes, []).append(buf)

    def close(self) -> None:
        self._free.clear()
        for a in self._arenas:
            try:
                a.close()
            except BufferError:
                pass  # a view is still referenced somewhere; the GC unmaps it later
