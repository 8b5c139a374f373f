"""The native read engine (io.read_engine = "native"): one C call per run of pages (native/read_pages.c).

Per page, in C and without the GIL: read the header block and check that it names exactly the blob the
index points at, then read the payload chunk by chunk into this I/O thread's chunk buffer, checksum each
chunk while it is in cache and copy it into the caller's page, then compare the CRC. Against the Python
engine this saves two passes over memory (the landed slot is neither re-read for its CRC nor for its
copy-out) and every per-page Python step between the preadv and the copy.

The caller's memory is written only through the operation's gate (native.Gate): OpState closes it when
the caller's bound passes or when it returns, waiting only for a chunk copy under way, so a read that
comes back from the device later lands in the chunk buffer and goes no further.

ReadPath (reads.py) keeps everything around it: the index lookup, read permits, per-page results,
counters, dropping bad pages. What it hands here is a run of (slot, digest, caller's page) of one payload.
"""

from __future__ import annotations

import threading
from typing import Optional

import numpy as np

from .. import native
from ..format.aligned import address_of, huge_aligned_view
from ..errors import L3InvariantError
from ..payload_slab import PayloadSlab
from ..state import CONTROL_TIMEOUT_S

FIELD = "io.read_engine"
# Bytes read, checksummed and copied per step. Large enough that each pread is one efficient device
# request (NVMe and virtio alike take 1 MiB requests whole), small enough to stay in a core's L2
# (1-2 MiB on current server cores) between the read, the CRC and the copy.
CHUNK_BYTES = 1 << 20
# Beside the chunk: the slot's header block (the payload's unaligned end + the 64 B header, <= 8 KiB).
TAIL_BYTES = 8192


class NativeReader:
    """Chunk buffers (one per read I/O thread) and the C call."""

    def __init__(self, threads: int):
        self._lib = native.load(FIELD, "native")
        # Allocated (and faulted in) at open, like the Python engine's landing areas. A thread stuck in
        # the kernel keeps its buffer; each of the `threads` I/O threads holds at most one at a time.
        self._free = [huge_aligned_view(CHUNK_BYTES + TAIL_BYTES) for _ in range(threads)]
        self._cond = threading.Condition()

    @staticmethod
    def new_gate() -> native.Gate:
        return native.Gate()

    def close_gate(self, gate: native.Gate, wait: bool) -> None:
        """No copy into the caller's memory starts from now on; with `wait`, also return only once the
        copies under way are done (memory copies of one chunk: a bound past CONTROL_TIMEOUT_S is a bug)."""
        if self._lib.cpl3_gate_close(gate, CONTROL_TIMEOUT_S if wait else 0.0) != 0 and wait:
            raise L3InvariantError(f"a native chunk copy into the caller's memory did not end within "
                                   f"{CONTROL_TIMEOUT_S:g} s")

    def read(self, pool: PayloadSlab, slots: list[int], offsets: list[int], digests: list[bytes], outs: list,
             gate: native.Gate) -> np.ndarray:
        """Read, check and deliver the pages (slot i at file offset offsets[i]); returns the items (their
        `status`, `detail`: native.OK or the reason) in the order given."""
        items = read_items(slots, offsets, digests, outs)
        buf = self._take()
        try:
            self._lib.cpl3_read_pages(pool.slab.fd, pool.tag, pool.rank, pool.page_bytes, pool.extent,
                                      items.ctypes.data, len(slots), address_of(buf), CHUNK_BYTES, gate)
        finally:
            self._give(buf)
        if (items["status"] == 0).any():
            raise L3InvariantError("cpl3_read_pages left pages without a status (its arguments broke the "
                                   "engine's contract)")
        return items

    def stats(self) -> dict:
        """The engine's own counters (the store's stats()["read_engine_stats"]): none here."""
        return {}

    def close(self) -> None:
        """At store close: the chunk buffers go with the object."""

    def _take(self) -> memoryview:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, CONTROL_TIMEOUT_S):
                raise L3InvariantError(f"no native read chunk buffer came back in {CONTROL_TIMEOUT_S:g} s (more "
                                       "runs at once than read I/O threads)")
            return self._free.pop()

    def _give(self, buf: memoryview) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


def read_items(slots: list[int], offsets: list[int], digests: list[bytes], outs: list) -> np.ndarray:
    """The C engines' per-page records (native.READ_ITEM) of a run: slot i at file offset offsets[i]."""
    items = np.zeros(len(slots), dtype=native.READ_ITEM)
    items["offset"] = offsets
    items["slot"] = slots
    items["dst"] = [_address(o) for o in outs]
    items["digest"] = digests
    return items


def _address(out) -> int:
    addr: Optional[int] = address_of(out)
    if addr is None:
        raise L3InvariantError("native read: an output page has no address (not a contiguous writable buffer)")
    return addr
