"""The io_uring read engine (io.read_engine = "uring"): one C call per run (native/read_uring.c) that keeps
the run's reads in flight together on a ring, and the choice of engine at store open.

Against the native engine (native/reads.py), whose checks, statuses and gate it shares: there each read
I/O thread has one pread in the device at a time, so queue depth costs threads; here each thread drives
a ring with up to io.uring_depth reads in flight (one io_uring_enter per round, not per page), so a
thread or two keep a fast drive busy and the threads left are for the CRC and the copy. ReadPath
(reads.py) drives it exactly as the native engine (same runs, statuses, bad-page handling).

One ring per read I/O thread, taken for a call and given back, as the native engine's chunk buffers:
a ring must not be driven by two threads at once, and one ring per store would need a lock or a
submitting thread of its own (a hand-off per run) for no more depth than the rings give together.

Where io_uring is refused (container seccomp profiles: EPERM or ENOSYS; sysctl kernel.io_uring_disabled:
EPERM; kernels before 5.11: no bounded waits), the store reads with the native engine instead and says
so once at open; stats()["read_engine_effective"] tells which engine reads.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading

import numpy as np

from .. import native
from ..errors import L3InvariantError
from .reads import FIELD, NativeReader, read_items
from ..payload_slab import PayloadSlab
from ..state import CONTROL_TIMEOUT_S

logger = logging.getLogger(__name__)

# Bytes per body request. 64 in flight (16 MiB) cover any drive's bandwidth-delay product; a piece is
# checksummed and copied while it is still in a core's L2.
PIECE_BYTES = 256 << 10
# A landing slot: a piece, or a page's head (its payload past the last whole piece + the header block).
SLOT_BYTES = PIECE_BYTES + 8192
# How long a batch whose caller's bound passed waits for its cancelled reads before leaving them (and
# their slots) to the kernel.
DRAIN_S = 1.0
# cpl3_uring_stats, in order.
STATS = ("enters", "reads", "short_read_resubmits", "stale_completions", "cancels", "late_slots",
         "registered_buffers", "reads_in_kernel", "free_slots")
# cpl3_uring_test_inject modes: faults the tests fake to show each guard at work.
INJECT = {"short": 1, "short_odd": 2, "replay": 3, "no_cancel": 4}
_FIX = {
    errno.EPERM: "allow the io_uring_setup, io_uring_enter and io_uring_register syscalls (the container's "
                 "seccomp profile) and set sysctl kernel.io_uring_disabled = 0",
    errno.ENOSYS: "use a kernel built with io_uring (CONFIG_IO_URING) and a seccomp profile that allows it",
    errno.EOPNOTSUPP: "use Linux >= 5.11 (the engine needs IORING_FEAT_EXT_ARG for bounded waits)",
}


class UringRefused(Exception):
    def __init__(self, err: int):
        self.errno = err
        super().__init__(f"{errno.errorcode.get(err, err)}: {os.strerror(err)}")

    def fix(self) -> str:
        return _FIX.get(self.errno, _FIX[errno.EPERM] if self.errno == errno.EACCES else
                        "check the kernel's io_uring support and the process's limits")


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, u32, u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64
    lib.cpl3_uring_open.argtypes = [u32, u64, ctypes.POINTER(ctypes.c_int32)]
    lib.cpl3_uring_open.restype = vp
    lib.cpl3_uring_read.argtypes = [vp, ctypes.c_int, u32, u32, u64, u64, vp, u64, u64, ctypes.POINTER(native.Gate),
                                    ctypes.c_double]
    lib.cpl3_uring_read.restype = ctypes.c_int
    lib.cpl3_uring_close.argtypes = [vp]
    lib.cpl3_uring_close.restype = ctypes.c_int
    lib.cpl3_uring_probe.argtypes = []
    lib.cpl3_uring_probe.restype = ctypes.c_int
    lib.cpl3_uring_stats.argtypes = [vp, vp, u64]
    lib.cpl3_uring_stats.restype = None
    lib.cpl3_uring_test_inject.argtypes = [vp, ctypes.c_int]
    lib.cpl3_uring_test_inject.restype = None
    return lib


def probe() -> int:
    """0 if this process can use io_uring (a ring set up, a NOP through io_uring_enter), else the errno."""
    return declare(native.load(FIELD, "uring")).cpl3_uring_probe()


def open_reader(io, rank: int) -> tuple[NativeReader | None, str]:
    """The reader for io.read_engine (None: the Python engine) and the engine in effect."""
    if io.read_engine == "python":
        return None, "python"
    if io.read_engine == "native":
        return NativeReader(io.threads), "native"
    lib = declare(native.load(FIELD, "uring"))
    try:
        err = lib.cpl3_uring_probe()
        if err:
            raise UringRefused(err)
        return UringReader(lib, io.threads, io.uring_depth), "uring"
    except UringRefused as e:
        logger.warning("L3 rank %d: io.read_engine = \"uring\": io_uring refused (%s); reading with the \"native\" "
                       "engine instead. To use io_uring, %s", rank, e, e.fix())
        return NativeReader(io.threads), "native"


class UringReader(NativeReader):
    """Rings (one per read I/O thread) and the C call; gates as the native engine's."""

    def __init__(self, lib: ctypes.CDLL, threads: int, depth: int):
        self._lib = lib
        self._rings: list[int] = []
        self._closed = False
        self._cond = threading.Condition()
        for _ in range(threads):
            err = ctypes.c_int32(0)
            ring = lib.cpl3_uring_open(depth, SLOT_BYTES, ctypes.byref(err))
            if not ring:  # none of these is in a call yet: close them all
                for opened in self._rings:
                    lib.cpl3_uring_close(opened)
                raise UringRefused(err.value)
            self._rings.append(ring)
        self._free = list(self._rings)

    def read(self, pool: PayloadSlab, slots: list[int], offsets: list[int], digests: list[bytes], outs: list,
             gate: native.Gate) -> np.ndarray:
        return self.read_fd(pool.slab.fd, pool.tag, pool.rank, pool.page_bytes, pool.extent,
                            read_items(slots, offsets, digests, outs), gate)

    def read_fd(self, fd: int, tag: int, rank: int, page_bytes: int, extent: int, items: np.ndarray,
                gate: native.Gate, drain_s: float = DRAIN_S) -> np.ndarray:
        """Read `items` (native.READ_ITEM) of the slab open at `fd`; each gets its status."""
        ring = self._take()
        if ring is None:  # the store closed (a read that was stuck before it reached us): nothing to read with
            items["status"] = native.CANCELLED
            return items
        try:
            rc = self._lib.cpl3_uring_read(ring, fd, tag, rank, page_bytes, extent, items.ctypes.data, len(items),
                                           PIECE_BYTES, gate, drain_s)
        finally:
            self._give(ring)
        if rc == -2:
            raise MemoryError("cpl3_uring_read: no memory for a run's request table")
        if rc == -3:
            raise L3InvariantError("cpl3_uring_read could neither submit nor wait (no read of its ring in flight "
                                   "and none it could start)")
        if rc < 0 or (items["status"] == 0).any():
            raise L3InvariantError("cpl3_uring_read left pages without a status (its arguments broke the "
                                   "engine's contract)")
        return items

    def stats(self) -> dict:
        """The open rings' counters, summed (read_engine_stats in the store's stats)."""
        total = np.zeros(len(STATS), dtype=np.uint64)
        out = np.zeros(len(STATS), dtype=np.uint64)
        with self._cond:  # a ring leaves self._rings under it before it is closed
            for ring in self._rings:
                self._lib.cpl3_uring_stats(ring, out.ctypes.data, len(STATS))
                total += out
            rings = len(self._rings)
        return {"rings": rings, **dict(zip(STATS, map(int, total)))}

    def inject(self, mode: str) -> None:
        """Tests only: fake a fault on every ring's next occasion (INJECT)."""
        for ring in self._rings:
            self._lib.cpl3_uring_test_inject(ring, INJECT[mode])

    def close(self) -> None:
        """Close the rings not in a call now; one in a call closes when it is given back."""
        with self._cond:
            self._closed = True
            rings, self._free = self._free, []
            self._cond.notify_all()
        for ring in rings:
            self._close_ring(ring)

    def _take(self):
        """A free ring, or None once closed. Rings in calls are at most the I/O threads, one each: not getting
        one in CONTROL_TIMEOUT_S means one leaked (loud)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self._closed, CONTROL_TIMEOUT_S):
                raise L3InvariantError(f"no io_uring ring came back in {CONTROL_TIMEOUT_S:g} s (more runs at once "
                                       "than read I/O threads)")
            return None if self._closed else self._free.pop()

    def _give(self, ring) -> None:
        with self._cond:
            if not self._closed:
                self._free.append(ring)
                self._cond.notify()
                return
        self._close_ring(ring)

    def _close_ring(self, ring) -> None:
        with self._cond:
            self._rings.remove(ring)
        late = self._lib.cpl3_uring_close(ring)
        if late:
            logger.warning("L3: %d io_uring read(s) still in the kernel at close; their landing memory stays "
                           "mapped until the process exits", late)
