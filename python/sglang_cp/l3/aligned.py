"""Page-aligned buffers for O_DIRECT (anonymous mmap is always page aligned)."""

from __future__ import annotations

import mmap
import threading

import numpy as np

ALIGN = 4096


def aligned_buffer(nbytes: int, populate: bool = False) -> mmap.mmap:
    """`populate` faults the pages in now: first touch of fresh memory is slow (VM balloon), and the
    write path should not pay it per page."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(-1, max(nbytes, ALIGN), flags=flags)


def address_of(buf) -> int | None:
    """Start address of a contiguous buffer, or None if it cannot be had without copying."""
    try:
        return np.frombuffer(buf, dtype=np.uint8).ctypes.data
    except (TypeError, ValueError):
        return None


class BounceBuffers:
    """One reusable aligned buffer per (thread, size): reads that cannot go zero-copy use it."""

    def __init__(self):
        self._local = threading.local()

    def get(self, nbytes: int) -> memoryview:
        cache = getattr(self._local, "bufs", None)
        if cache is None:
            cache = self._local.bufs = {}
        buf = cache.get(nbytes)
        if buf is None:
            buf = cache[nbytes] = aligned_buffer(nbytes)
        return memoryview(buf)[:nbytes]
