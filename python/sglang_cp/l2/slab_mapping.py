"""Map one pool's slab files back to back at a single hugepage-aligned address.

Upstream indexes a host pool as one tensor, so its slabs must be virtually
contiguous. We reserve the whole range first (PROT_NONE, no backing) and then map
each slab file over its part with MAP_FIXED: one virtual range, several files,
several registrations. Nothing here ever falls back to anonymous memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as errno_mod
import logging
import mmap
import os
import threading
from typing import Optional, Sequence

from sglang_cp.l2.errors import InsufficientHugepagesError
from sglang_cp.l2.hugetlbfs import HugetlbfsMount
from sglang_cp.l2.slab_files import hold_owner_lock
from sglang_cp.l2.slab_plan import SlabPlan, fmt_gb, fmt_page

logger = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.memset.restype = ctypes.c_void_p
_libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _mmap(addr: Optional[int], length: int, prot: int, flags: int, fd: int) -> int:
    ptr = _libc.mmap(addr, length, prot, flags, fd, 0)
    if ptr is None or ptr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ptr


class SlabMapping:
    """The slabs of one pool: files, one reservation, and their registration state."""

    def __init__(self, plan: SlabPlan, mount: HugetlbfsMount, paths: Sequence[str]):
        if len(paths) != len(plan.slabs):
            raise ValueError(f"{len(paths)} file names for {len(plan.slabs)} slabs")
        self.plan = plan
        self.mount = mount
        self.paths = list(paths)
        self.base = 0
        self._reserve = (0, 0)
        self._fds: list[int] = []
        self._created: list[str] = []
        self.registered: list[tuple[int, int]] = []  # (ptr, bytes) per registered slab
        self._lock = threading.Lock()
        self.closed = False

    def slab_ranges(self) -> list[tuple[int, int]]:
        """(address, mapped bytes) of every slab: exactly the cudaHostRegister calls."""
        return [(self.base + s.offset, s.mapped_bytes) for s in self.plan.slabs]

    def _no_pages(self, slab, cause) -> InsufficientHugepagesError:
        hp = self.plan.hugepage_size
        return InsufficientHugepagesError(
            f"mapping HiCache host pool {self.plan.label!r} slab {slab.index + 1}/{len(self.plan.slabs)} "
            f"({fmt_gb(slab.mapped_bytes)}, {slab.mapped_bytes // hp} x {fmt_page(hp)} hugepages) on "
            f"{self.mount.path} failed with ENOMEM ({cause}) after the preflight passed: hugepages "
            f"were taken concurrently. Fix: raise vm.nr_hugepages or lower --hicache-size / --hicache-ratio"
        )

    def map(self, prefault_threads: int = 1) -> "SlabMapping":
        """Create, size and map every slab file; fault every page in before returning.

        cudaHostRegister pins what is there, so pages must exist first. One thread uses
        MAP_POPULATE; several split the range and fault it in parallel (the kernel zeroes
        each hugepage on first touch, which is what dominates at hundreds of GiB).
        """
        hp = self.plan.hugepage_size
        reserve_len = self.plan.mapped_bytes + hp
        raw = _mmap(None, reserve_len, 0,  # PROT_NONE: address space only
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1)
        self._reserve = (raw, reserve_len)
        self.base = -(-raw // hp) * hp
        populate = _MAP_POPULATE if prefault_threads <= 1 else 0
        try:
            for slab, path in zip(self.plan.slabs, self.paths):
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
                self._fds.append(fd)
                self._created.append(path)
                hold_owner_lock(fd, path)  # held while mapped: tells reclaimers on this mount we are alive
                os.ftruncate(fd, slab.mapped_bytes)
                try:
                    # A MAP_SHARED hugetlbfs mapping reserves all its pages here: no
                    # SIGBUS later, ENOMEM now if they are gone.
                    _mmap(self.base + slab.offset, slab.mapped_bytes, mmap.PROT_READ | mmap.PROT_WRITE,
                          mmap.MAP_SHARED | _MAP_FIXED | populate, fd)
                except OSError as e:
                    if e.errno == errno_mod.ENOMEM:
                        raise self._no_pages(slab, "mmap") from e
                    raise
            if not populate:
                self._prefault(prefault_threads)
        except BaseException:
            self.close()
            raise
        return self

    def _prefault(self, threads: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        hp = self.plan.hugepage_size
        chunk = max(hp, -(-self.plan.mapped_bytes // (threads * 4)) // hp * hp)
        jobs = [
            (slab, addr, min(chunk, self.base + slab.offset + slab.mapped_bytes - addr))
            for slab in self.plan.slabs
            for addr in range(self.base + slab.offset, self.base + slab.offset + slab.mapped_bytes, chunk)
        ]

        def fault(job):
            slab, addr, length = job
            # ctypes drops the GIL, so the threads fault in parallel.
            if _libc.madvise(addr, length, _MADV_POPULATE_WRITE) == 0:
                return
            err = ctypes.get_errno()
            if err == errno_mod.ENOMEM:
                raise self._no_pages(slab, "MADV_POPULATE_WRITE")
            if err != errno_mod.EINVAL:
                raise OSError(err, os.strerror(err))
            _libc.memset(addr, 0, length)  # kernel < 5.14: touch instead (pages are reserved)

        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(fault, jobs))

    def close(self) -> None:
        """Unregister (if needed), unmap, close and unlink. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self.registered:
                from sglang_cp.l2.registration import unregister_mapping

                try:
                    unregister_mapping(self)
                except Exception as e:  # e.g. at interpreter exit, after CUDA is gone
                    logger.warning("unregistering L2 slabs of %r failed: %s", self.plan.label, e)
            raw, length = self._reserve
            if raw:
                # One munmap over the reservation also drops every MAP_FIXED slab in it.
                if _libc.munmap(raw, length) != 0:
                    logger.warning("munmap of L2 slabs of %r failed: errno %d", self.plan.label, ctypes.get_errno())
                self._reserve = (0, 0)
            for fd in self._fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds = []
            for path in self._created:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            self._created = []

    def __repr__(self) -> str:
        return (f"SlabMapping({self.plan.label!r}, {len(self.plan.slabs)} slabs, "
                f"base={self.base:#x}, closed={self.closed})")
