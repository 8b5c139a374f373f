"""One preallocated slab file per (rank, disk, payload): fixed slots, O_DIRECT I/O.

`fault_injector` is the seam for fault tests: a callable `(op, slab, slot)` invoked before every
read/write/sync that may raise OSError (EIO, ENOSPC, ENODEV...) exactly as the kernel would.
The file is opened through `files.open_private`: 0600, no link followed, refused unless it is a regular
file of ours, all before the first truncate or write.
"""

from __future__ import annotations

import errno
import os
from typing import Callable, Optional

from .blob import ALIGN, write_extent
from ..errors import L3InvariantError, L3StartupError
from .files import fsync_dir, open_private

FaultInjector = Callable[[str, "DiskSlab", int], None]


class DiskSlab:
    def __init__(self, path: str, *, slot_bytes: int, num_slots: int, page_bytes: int,
                 fault_injector: Optional[FaultInjector] = None, disk_index: int = 0, field: str = "disks"):
        if slot_bytes % ALIGN or slot_bytes < write_extent(page_bytes):
            raise L3StartupError(
                f"slot_bytes for {os.path.basename(path)}: {slot_bytes} must be a multiple of {ALIGN} and at least "
                f"{write_extent(page_bytes)} (page {page_bytes} B + 64 B header, rounded up)")
        self.path = path
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.page_bytes = page_bytes
        self.extent = write_extent(page_bytes)
        self.disk_index = disk_index
        self.fault_injector = fault_injector
        size = slot_bytes * num_slots
        existed = os.path.lexists(path)
        try:
            self.fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, field)
        except OSError as e:
            raise L3StartupError(
                f"{field}: cannot open slab file '{path}' with O_DIRECT ({e.strerror}); the directory must be on "
                "a filesystem that supports O_DIRECT (ext4/xfs; tmpfs only from Linux 6.6) and be writable") from None
        try:
            if os.fstat(self.fd).st_size > size:
                os.ftruncate(self.fd, size)  # slots beyond the new count are dropped by recovery
            os.posix_fallocate(self.fd, 0, size)
            if not existed:
                fsync_dir(os.path.dirname(path))  # the new file's directory entry survives a power loss
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise L3StartupError(
                    f"{field}.capacity_gb: not enough free space to preallocate {size / 1e9:.3f} GB for '{path}'; "
                    "free space on that disk or lower capacity_gb") from None
            raise L3StartupError(f"{field}: cannot preallocate '{path}' ({e.strerror})") from None

    def _offset(self, slot: int) -> int:
        if not (0 <= slot < self.num_slots):
            raise L3InvariantError(f"slab '{self.path}': slot {slot} overruns the slab ({self.num_slots} slots)")
        return slot * self.slot_bytes

    def slot_offset(self, slot: int) -> int:
        """File offset of a slot, for reads issued outside this class (the native read engine): checked
        against the slab's size and passed through the fault seam as a read of that slot."""
        off = self._offset(slot)
        if self.fault_injector:
            self.fault_injector("read", self, slot)
        return off

    def write_slot(self, slot: int, image: list[memoryview]) -> None:
        self.write_slots(slot, [image])

    def write_slots(self, first_slot: int, images: list[list[memoryview]]) -> None:
        """Write consecutive slots in one pwritev. Each image is the iovec list of one slot (payload +
        header, `extent` bytes, every piece 4 KiB aligned); coalescing needs slot_bytes == extent."""
        off = self._check_run(first_slot, images)
        self._inject_writes(first_slot, len(images))
        n = os.pwritev(self.fd, [v for img in images for v in img], off)
        self._check_written(n, first_slot, images)

    def write_runs(self, pwritev_runs: Callable[[int, list[int], list[list[memoryview]]], list[int]],
                   runs: list[tuple[int, list[list[memoryview]]]]) -> list[Optional[OSError]]:
        """Write each run (first slot, images: as write_slots) with one pwritev, every run of the group
        in one call of `pwritev_runs(fd, offsets, iovecs per run)` -> bytes written or -errno per run (the
        native library's, one GIL release for the group); per run None or its OSError. A run the fault
        seam fails is not written; the others are."""
        errors: list[Optional[OSError]] = [None] * len(runs)
        todo, offsets, iovecs = [], [], []
        for i, (first, images) in enumerate(runs):
            off = self._check_run(first, images)
            try:
                self._inject_writes(first, len(images))
            except OSError as err:
                errors[i] = err
                continue
            todo.append(i)
            offsets.append(off)
            iovecs.append([v for img in images for v in img])
        if todo:
            for i, n in zip(todo, pwritev_runs(self.fd, offsets, iovecs)):
                first, images = runs[i]
                try:
                    if n < 0:
                        raise OSError(-n, os.strerror(-n))
                    self._check_written(n, first, images)
                except OSError as err:
                    errors[i] = err
        return errors

    def _check_run(self, first_slot: int, images: list[list[memoryview]]) -> int:
        """The run's file offset, once its slots lie in the slab and every image is one slot's extent."""
        if len(images) > 1 and self.slot_bytes != self.extent:
            raise L3InvariantError(f"slab '{self.path}': coalesced write needs slot_bytes == extent")
        off = self._offset(first_slot)
        self._offset(first_slot + len(images) - 1)
        for img in images:
            size = sum(v.nbytes for v in img)
            if size != self.extent:
                raise L3InvariantError(f"slab '{self.path}': image of {size} B, slot extent is {self.extent} B")
        return off

    def _inject_writes(self, first_slot: int, count: int) -> None:
        if self.fault_injector:
            for k in range(count):
                self.fault_injector("write", self, first_slot + k)

    def _check_written(self, n: int, first_slot: int, images: list[list[memoryview]]) -> None:
        want = self.extent * len(images)
        if n != want:
            raise OSError(errno.EIO, f"short write {n}/{want} B at slots {first_slot}+{len(images)}")

    def read_slot(self, slot: int, iovecs: list[memoryview], offset_in_slot: int = 0) -> int:
        """preadv into aligned iovecs at `offset_in_slot`; returns bytes read (may be short: caller checks)."""
        off = self._offset(slot) + offset_in_slot
        if offset_in_slot + sum(v.nbytes for v in iovecs) > self.slot_bytes:
            raise L3InvariantError(f"slab '{self.path}': read past the end of slot {slot}")
        if self.fault_injector:
            self.fault_injector("read", self, slot)
        return os.preadv(self.fd, iovecs, off)

    def read_slots(self, first_slot: int, count: int, iovecs: list[memoryview]) -> int:
        """preadv whole consecutive slots (coalesced read); returns bytes read (caller checks)."""
        off = self._offset(first_slot)
        self._offset(first_slot + count - 1)
        if sum(v.nbytes for v in iovecs) != count * self.extent or self.slot_bytes != self.extent:
            raise L3InvariantError(f"slab '{self.path}': coalesced read must cover whole contiguous slots")
        if self.fault_injector:
            for k in range(count):
                self.fault_injector("read", self, first_slot + k)
        return os.preadv(self.fd, iovecs, off)

    def sync(self) -> None:
        if self.fault_injector:
            self.fault_injector("sync", self, -1)
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
