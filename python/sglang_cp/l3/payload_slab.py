"""One payload's slab on this rank: slot allocator, LRU, slot owners, and verified slot I/O.

Bookkeeping (slots, lru, owner) is touched only by the write thread (and by recovery before threads
start). Slot I/O (`seal_*`, `verify_landed`) runs on I/O threads and touches only the slab and the given buffers.
"""

from __future__ import annotations

from .format.aligned import BounceBuffers, address_of
from .format.blob import (ALIGN, HEADER_BYTES, BlobError, BlobHeader, check_identity, crc32c, header_block, pack_header,
                   parse_header, payload_tag, write_extent)
from .format.disk_slab import DiskSlab
from .errors import L3InvariantError
from .gc import PageLRU
from .format.index import IndexEntry
from .slot_allocator import SlotAllocator


class PayloadSlab:
    def __init__(self, name: str, page_bytes: int, rank: int, slab: DiskSlab):
        self.name = name
        self.tag = payload_tag(name)
        self.page_bytes = page_bytes
        self.extent = write_extent(page_bytes)
        self.rank = rank
        self.slab = slab
        self.slots = SlotAllocator(slab.num_slots, name)
        self.lru = PageLRU()
        self.owner: dict[int, bytes] = {}

    # -- bookkeeping (write thread) -----------------------------------------------------------------

    def occupy(self, ikey: bytes, entry: IndexEntry) -> None:
        prev = self.owner.get(entry.slot)
        if prev is not None and prev != ikey:
            raise L3InvariantError(f"payload {self.name!r}: slot {entry.slot} already owned by another key")
        self.owner[entry.slot] = ikey
        self.lru.add(ikey, entry)

    def release(self, ikey: bytes, entry: IndexEntry) -> None:
        """Forget a page whose index entry is already deleted, then free its slot (order matters)."""
        if self.owner.get(entry.slot) != ikey:
            raise L3InvariantError(f"payload {self.name!r}: releasing slot {entry.slot} not owned by that key")
        del self.owner[entry.slot]
        self.lru.remove(ikey)
        self.slots.free_slot(entry.slot)

    def reset(self) -> None:
        self.slots.reset()
        self.lru.clear()
        self.owner.clear()

    # -- slot I/O (I/O threads) ---------------------------------------------------------------------

    def seal_image(self, image: memoryview, slot: int, digest: bytes, seq: int, pcrc: int) -> list[memoryview]:
        """`image[:page_bytes]` (staging) already holds the payload, whose CRC32C `pcrc` the submitter took
        after copying it (staging is ours from the copy on, so it holds); add the header: one iovec."""
        image[self.page_bytes: self.page_bytes + HEADER_BYTES] = self._header(slot, digest, seq, pcrc)
        return [image[: self.extent]]

    def seal_zero_copy(self, src: memoryview, tail: memoryview, slot: int, digest: bytes, seq: int) -> list[memoryview]:
        """Write straight from the caller's 4 KiB-aligned page: iovecs [aligned part of src, tail block],
        where the tail block carries the unaligned end of the payload and the header."""
        pb, aligned = self.page_bytes, self.page_bytes // ALIGN * ALIGN
        pcrc = crc32c(src)
        cut = pb - aligned
        tail[:cut] = src[aligned:]
        tail[cut: cut + HEADER_BYTES] = self._header(slot, digest, seq, pcrc)
        return [src[:aligned], tail[: self.extent - aligned]]

    def can_zero_copy(self, src: memoryview) -> bool:
        addr = address_of(src)
        return self.page_bytes >= ALIGN and addr is not None and addr % ALIGN == 0

    def tail_bytes(self) -> int:
        return self.extent - self.page_bytes // ALIGN * ALIGN

    def _header(self, slot: int, digest: bytes, seq: int, pcrc: int) -> bytes:
        return pack_header(BlobHeader(self.tag, self.rank, slot, self.page_bytes, digest, seq, pcrc))

    def verify_landed(self, image: memoryview, slot: int, digest: bytes) -> BlobHeader:
        """Check a slot image read into store memory (`image`: one whole extent, payload then header):
        identity (tag, rank, slot, length, key digest) and payload CRC. Raises BlobError."""
        pb = self.page_bytes
        h = self._check(image[pb: pb + HEADER_BYTES], slot, digest)
        if crc32c(image[:pb]) != h.payload_crc:
            raise BlobError("crc_mismatch")
        return h

    def can_read_run(self) -> bool:
        """Consecutive slots are consecutive extents in the slab: a run can be read with one preadv."""
        return self.slab.slot_bytes == self.extent

    def read_header(self, slot: int, bounce: BounceBuffers) -> BlobHeader:
        """Header-only read (recovery): one or two aligned blocks, not the whole slot."""
        off, length = header_block(self.page_bytes)
        buf = bounce.get(length)
        n = self.slab.read_slot(slot, [buf], offset_in_slot=off)
        if n != length:
            raise BlobError("short_read", f"{n}/{length} B")
        start = self.page_bytes - off
        return parse_header(buf[start: start + HEADER_BYTES])

    def verify_payload(self, slot: int, h: BlobHeader, bounce: BounceBuffers) -> None:
        buf = bounce.get(self.extent)
        n = self.slab.read_slot(slot, [buf])
        if n != self.extent:
            raise BlobError("short_read", f"{n}/{self.extent} B")
        if crc32c(buf[: self.page_bytes]) != h.payload_crc:
            raise BlobError("crc_mismatch")

    def _check(self, hdr, slot: int, digest: bytes) -> BlobHeader:
        h = parse_header(hdr)
        check_identity(h, payload_tag=self.tag, rank=self.rank, slot=slot, length=self.page_bytes, digest=digest)
        return h

    def entry_fits(self, e: IndexEntry) -> bool:
        """An index entry can only name a slot of this slab if geometry and disk agree."""
        return (e.rank == self.rank and e.payload_tag == self.tag and e.length == self.page_bytes
                and e.disk == self.slab.disk_index and 0 <= e.slot < self.slab.num_slots)
