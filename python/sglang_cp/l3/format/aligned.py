"""Page-aligned buffers for O_DIRECT (anonymous mmap is always page aligned)."""

from __future__ import annotations

import mmap
import threading

import numpy as np

from .blob import ALIGN


def aligned_buffer(nbytes: int, populate: bool = False, huge: bool = False) -> mmap.mmap:
    """`populate` faults the pages in now: first touch of fresh memory is slow (VM balloon), and the
    write path should not pay it per page.

    `huge` asks for transparent huge pages (MADV_HUGEPAGE; THP is commonly in `madvise` mode): every
    O_DIRECT request pins its buffer and every staging copy walks it, and both cost per 4 KiB page.
    Measured on the CI VM, together with returning staging tokens at pwrite completion, 3.2 MB-page
    submit_write went from 0.54-0.73x to 0.86-1.07x raw disk.
    Without THP support the advice is ignored and the buffer is ordinary 4 KiB pages."""
    size = max(nbytes, ALIGN)
    if not huge:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if populate else 0)
        return mmap.mmap(-1, size, flags=flags)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buf.madvise(advice)  # must precede the first touch, so no MAP_POPULATE above
        except OSError:
            pass
    if populate:
        np.frombuffer(buf, dtype=np.uint8)[::ALIGN] = 0  # one write per 4 KiB page faults it all in
    return buf


def huge_page_bytes() -> int:
    """The transparent huge page size (2 MiB on x86-64), or 2 MiB where the kernel does not say."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


def huge_aligned_view(nbytes: int, populate: bool = True) -> memoryview:
    """A writable view of at least `nbytes` that starts on a huge page boundary and spans whole huge
    pages, advised for THP and (by default) faulted in now. The view keeps its mapping alive.

    Unlike `aligned_buffer(huge=True)`, whose mapping starts anywhere on a 4 KiB boundary (a 3 MiB
    mapping holds one huge page at most), every byte of the view can be a huge page: memory that a
    preadv lands in is then physically contiguous, so the block layer builds a request from a few
    large segments instead of one per 4 KiB page. On the CI VM (virtio-blk, 254 segments per request)
    cold 3-page reads into a 3 MiB `aligned_buffer(huge=True)` area ran at 1.5 GB/s, into this view
    at 3.1 GB/s. Without THP support the view is ordinary 4 KiB pages."""
    huge = huge_page_bytes()
    size = -(-max(nbytes, 1) // huge) * huge
    buf = mmap.mmap(-1, size + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # slack to align in
    off = -address_of(buf) % huge
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buf.madvise(advice, off, size)  # before the first touch
        except OSError:
            pass
    view = memoryview(buf)[off:off + size]
    if populate:
        np.frombuffer(view, dtype=np.uint8)[::ALIGN] = 0
    return view


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
